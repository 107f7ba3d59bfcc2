"""A GGUF file's tokenizer, rebuilt from its metadata as a ``tokenizers`` tokenizer.json.

llama.cpp stores a byte-level BPE tokenizer (``tokenizer.ggml.model`` "gpt2": GPT-2,
Llama 3, Qwen2 and Qwen3) as its tokens in id order, its merges, each token's type and
the name of its pre-tokenizer (``tokenizer.ggml.pre``), whose split pattern is the
tokenizer's own. Control tokens become special added tokens; a BOS the file says to add
is added by the post-processor, as the checkpoint's tokenizer.json would.

SentencePiece tokenizers (``llama``: Llama 2, Mistral) and pre-tokenizers not named
below are not rebuilt: such a file serves token-id prompts, and says so when loaded.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

# The split patterns of llama.cpp's pre-tokenizer names (as each model's tokenizer.json
# writes them). None: GPT-2's own, which the byte-level pre-tokenizer applies itself.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS: dict[str, str | None] = {
    "gpt-2": None,
    "default": None,
    "llama-bpe": LLAMA3_SPLIT,
    "llama3": LLAMA3_SPLIT,
    "smaug-bpe": LLAMA3_SPLIT,
    "qwen2": QWEN2_SPLIT,
}
# Llama 3's merges apply only to pieces not in the vocabulary whole.
IGNORES_MERGES = {"llama-bpe", "llama3", "smaug-bpe"}
CONTROL = 3  # llama.cpp's token type of a special token
USER_DEFINED = 4


def rebuild(fields: dict[str, Any]) -> tuple[str | None, str | None]:
    """(tokenizer.json text, None), or (None, why it was not rebuilt)."""
    model = fields.get("tokenizer.ggml.model")
    if model in (None, "no_vocab"):
        return None, "the file carries no vocabulary"
    if model != "gpt2":
        return None, f"tokenizer model {model!r} (SentencePiece) is not rebuilt yet"
    pre = str(fields.get("tokenizer.ggml.pre", "default"))
    if pre not in PRE_TOKENIZERS:
        return None, f"pre-tokenizer {pre!r} is not one of {', '.join(PRE_TOKENIZERS)}"
    tokens: list[str] = list(fields["tokenizer.ggml.tokens"])
    types = list(fields.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(merge.split(" ", 1)) for merge in fields.get("tokenizer.ggml.merges", [])]
    vocab = {token: index for index, token in enumerate(tokens)}
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in IGNORES_MERGES)
    )
    split = PRE_TOKENIZERS[pre]
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tokenizer.decoder = decoders.ByteLevel()
    added = [
        AddedToken(token, special=kind == CONTROL, normalized=False)
        for token, kind in zip(tokens, types, strict=True)
        if kind in (CONTROL, USER_DEFINED)
    ]
    if added:
        tokenizer.add_tokens(added)
    bos = fields.get("tokenizer.ggml.bos_token_id")
    if fields.get("tokenizer.ggml.add_bos_token") and bos is not None:
        text = tokens[int(bos)]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{text} $A", pair=f"{text} $A {text} $B", special_tokens=[(text, int(bos))]
        )
    return tokenizer.to_str(), None


def tokenizer_config(fields: dict[str, Any]) -> dict[str, Any]:
    """What tokenizer_config.json carries: the chat template and the BOS and EOS texts
    it may name."""
    tokens = fields.get("tokenizer.ggml.tokens") or []
    config: dict[str, Any] = {}
    for name in ("bos", "eos"):
        index = fields.get(f"tokenizer.ggml.{name}_token_id")
        if index is not None and int(index) < len(tokens):
            config[f"{name}_token"] = tokens[int(index)]
    if fields.get("tokenizer.chat_template"):
        config["chat_template"] = str(fields["tokenizer.chat_template"])
    return config
