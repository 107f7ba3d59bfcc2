"""BPE vocabularies with merges in the file, as ``tokenizers`` tokenizers.

* Byte-level BPE (``tokenizer.ggml.model`` "gpt2": GPT-2, Llama 3, Qwen2 and Qwen3,
  DeepSeek, Mistral's Tekken, SmolLM): tokens are spelled in GPT-2's byte alphabet, and
  the text is cut into words by the file's pre-tokenizer (``tokenizer.ggml.pre``)
  before merging.
* Gemma 4's (``tokenizer.ggml.model`` "gemma4"): SentencePiece-style, on the UTF-8
  text itself with spaces written as "▁", cut only into lines and runs of newlines;
  what no merge reaches is spelled as ``<0xNN>`` byte tokens. llama.cpp takes a run of
  newlines that is a token whole; everything else is merged from single characters.
"""

from __future__ import annotations

from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from updraft.checkpoints.gguf_vocab import pre_tokenizers as splits
from updraft.checkpoints.gguf_vocab import special

SPACE = "\u2581"
# llama.cpp's pre-tokenizers that add a BOS unless the file says otherwise.
ADDS_BOS = {"llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "tekken"}


def file_merges(fields: dict[str, Any]) -> list[tuple[str, str]]:
    """The file's merges: "left right", cut at the first space after the first
    character, as llama.cpp reads them."""
    merges = []
    tokens = set(fields["tokenizer.ggml.tokens"])
    for index, merge in enumerate(fields.get("tokenizer.ggml.merges") or []):
        cut = merge.find(" ", 1)
        left, right = (merge[:cut], merge[cut + 1 :]) if cut > 0 else (merge, "")
        # what tokenizers' BPE requires of each merge (it panics on some others)
        if not (left in tokens and right in tokens and left + right in tokens):
            raise ValueError(
                f"tokenizer.ggml.merges item {index} ({merge!r}) does not join two tokens "
                "into a token"
            )
        merges.append((left, right))
    return merges


def byte_level(fields: dict[str, Any], pre: str) -> Tokenizer:
    splitting = splits.splitting(pre)
    tokens: list[str] = list(fields["tokenizer.ggml.tokens"])
    tokenizer = Tokenizer(
        models.BPE(
            vocab={token: i for i, token in enumerate(tokens)},
            merges=file_merges(fields),
            ignore_merges=splitting.ignore_merges,
        )
    )
    tokenizer.pre_tokenizer = splits.byte_level(pre)
    tokenizer.decoder = decoders.ByteLevel()
    special.add_special_tokens(tokenizer, fields)
    special.set_added_bos_eos(tokenizer, fields, special.adds_bos(fields, pre in ADDS_BOS))
    return tokenizer


def gemma4(fields: dict[str, Any]) -> Tokenizer:
    tokens: list[str] = list(fields["tokenizer.ggml.tokens"])
    unknown = int(fields.get("tokenizer.ggml.unknown_token_id", -1))
    tokenizer = Tokenizer(
        models.BPE(
            vocab={token: i for i, token in enumerate(tokens)},
            merges=file_merges(fields),
            unk_token=tokens[unknown] if 0 <= unknown < len(tokens) else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    tokenizer.normalizer = normalizers.Replace(" ", SPACE)
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|\n+"), behavior="isolated")
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    special.add_special_tokens(tokenizer, fields)
    # llama.cpp always adds Gemma 4's BOS (its chat template writes none).
    special.set_added_bos_eos(tokenizer, fields, add_bos=True)
    return tokenizer
