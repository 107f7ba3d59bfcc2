"""A GGUF file's tokenizer, rebuilt from its metadata as a ``tokenizers`` tokenizer.json
that gives the ids llama.cpp gives.

The file stores the tokens in id order, each token's type and score, the merges of a
BPE vocabulary, the tokenizer's kind (``tokenizer.ggml.model``) and, for byte-level
BPE, the name of its pre-tokenizer (``tokenizer.ggml.pre``). One module per kind:
``spm`` (SentencePiece), ``bpe`` (byte-level and Gemma 4's), with ``pre_tokenizers``
(the split patterns by name) and ``special`` (added tokens, BOS and EOS); ``stops``
lists the ids that end a turn.

A kind or pre-tokenizer not known here is refused by name: the file then serves
token-id prompts and says why when loaded.
"""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer

from updraft.checkpoints.gguf_vocab import bpe, spm
from updraft.checkpoints.gguf_vocab.pre_tokenizers import UnknownPreTokenizer

KINDS = ("llama", "gpt2", "gemma4")


class NotRebuilt(ValueError):
    """The file's vocabulary is of a kind, or names a pre-tokenizer, not known here."""


def build(fields: dict[str, Any]) -> Tokenizer:
    """The tokenizer the file's metadata describes; NotRebuilt, saying why, if none."""
    kind = fields.get("tokenizer.ggml.model")
    if kind in (None, "no_vocab", "none") or not fields.get("tokenizer.ggml.tokens"):
        raise NotRebuilt("the file carries no vocabulary")
    if kind == "llama":
        return spm.rebuild(fields)
    if kind == "gemma4":
        return bpe.gemma4(fields)
    if kind != "gpt2":
        raise NotRebuilt(f"tokenizer model {kind!r} (tokenizer.ggml.model) is not one of {KINDS}")
    try:
        return bpe.byte_level(fields, str(fields.get("tokenizer.ggml.pre", "default")))
    except UnknownPreTokenizer as error:
        raise NotRebuilt(str(error)) from error


def rebuild(fields: dict[str, Any]) -> tuple[str | None, str | None]:
    """(tokenizer.json text, None), or (None, why it was not rebuilt)."""
    try:
        return build(fields).to_str(), None
    except NotRebuilt as error:
        return None, str(error)


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
