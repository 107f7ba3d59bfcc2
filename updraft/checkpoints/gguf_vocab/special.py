"""The tokens a GGUF vocabulary marks as more than text, as ``tokenizers`` sees them:
control and user-defined tokens matched whole, and the BOS and EOS a file says to add.

llama.cpp's token types (``tokenizer.ggml.token_type``): 1 normal, 2 unknown, 3
control, 4 user-defined, 5 unused, 6 byte. It matches control and unknown tokens in a
text only when asked to parse special tokens, and user-defined ones always: here the
first are special added tokens (``encode_special_tokens`` leaves them as text), the
second plain added tokens.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Tokenizer, processors

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
# llama.cpp strips the blanks after these tokens for Phi-3 vocabularies, which it knows
# by their model name; these few keep them.
_PHI3_NAMES = ("phi-3", "phi3")
_PHI3_KEEP_BLANKS = {"<unk>", "<s>", "<|endoftext|>"}


def per_token(fields: dict[str, Any], key: str, default: float) -> list:
    """The array ``key`` holds one entry a token (``default`` for each when absent)."""
    count = len(fields["tokenizer.ggml.tokens"])
    values = fields.get(key)
    if values is None:
        return [default] * count
    if len(values) < count:
        raise ValueError(f"{key} has {len(values)} entries for {count} tokens")
    return list(values[:count])


def token_types(fields: dict[str, Any]) -> list[int]:
    return [int(kind) for kind in per_token(fields, "tokenizer.ggml.token_type", NORMAL)]


def add_special_tokens(tokenizer: Tokenizer, fields: dict[str, Any]) -> None:
    """Control, unknown and user-defined tokens, as added tokens matched whole."""
    name = str(fields.get("general.name", "")).lower()
    strips_after = any(phi in name for phi in _PHI3_NAMES)
    added = []
    for token, kind in zip(fields["tokenizer.ggml.tokens"], token_types(fields), strict=True):
        if kind in (CONTROL, UNKNOWN, USER_DEFINED):
            rstrip = strips_after and token not in _PHI3_KEEP_BLANKS
            added.append(
                AddedToken(token, special=kind != USER_DEFINED, normalized=False, rstrip=rstrip)
            )
    if added:
        tokenizer.add_tokens(added)


def adds_bos(fields: dict[str, Any], by_default: bool) -> bool:
    flag = fields.get("tokenizer.ggml.add_bos_token")
    return by_default if flag is None else bool(flag)


def set_added_bos_eos(tokenizer: Tokenizer, fields: dict[str, Any], add_bos: bool) -> None:
    """The BOS (and the EOS) the file says to add around a text, as its tokenizer.json's
    post-processor would."""
    tokens = fields["tokenizer.ggml.tokens"]
    add_eos = bool(fields.get("tokenizer.ggml.add_eos_token"))
    ends = {}
    for name, wanted in (("bos", add_bos), ("eos", add_eos)):
        index = fields.get(f"tokenizer.ggml.{name}_token_id")
        if wanted and index is not None and 0 <= int(index) < len(tokens):
            ends[name] = (tokens[int(index)], int(index))
    if not ends:
        return
    bos = f"{ends['bos'][0]} " if "bos" in ends else ""
    eos = f" {ends['eos'][0]}" if "eos" in ends else ""
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos}$A{eos}",
        pair=f"{bos}$A{eos} {bos}$B{eos}",
        special_tokens=list(set(ends.values())),
    )
