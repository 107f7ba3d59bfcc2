"""A SentencePiece vocabulary (``tokenizer.ggml.model`` "llama": Llama 2, Mistral v0.1
to v0.3, Phi-3, Gemma) as a ``tokenizers`` BPE tokenizer that gives llama.cpp's ids.

llama.cpp tokenizes such a vocabulary by merging, again and again, the adjacent pair of
pieces whose joined text is a token of the highest score (the leftmost on a tie), then
spells what is left that is not a token as its UTF-8 bytes (``<0xNN>``). A BPE model
whose merges are every pair of tokens that joins into a token, ranked by that token's
score, does the same; its byte fallback spells the rest. Spaces are written as "▁",
and each stretch of text between special tokens gets one in front when the file says
so (``tokenizer.ggml.add_space_prefix``, on unless it says not).
"""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer, decoders, models, normalizers

from updraft.checkpoints.gguf_vocab import special

SPACE = "\u2581"


def merges_by_score(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Every (left, right) pair of tokens that joins into a token, the best-scored
    joined token first; pairs of equal score in token order, shorter left first."""
    index = {token: i for i, token in enumerate(tokens)}
    ranked = []
    for joined, i in index.items():
        for cut in range(1, len(joined)):
            left, right = joined[:cut], joined[cut:]
            if left in index and right in index:
                ranked.append((-scores[i], i, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def rebuild(fields: dict[str, Any]) -> Tokenizer:
    tokens: list[str] = list(fields["tokenizer.ggml.tokens"])
    scores = [float(s) for s in special.per_token(fields, "tokenizer.ggml.scores", 0.0)]
    vocab = {token: i for i, token in enumerate(tokens)}
    unknown = int(fields.get("tokenizer.ggml.unknown_token_id", 0))
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges_by_score(tokens, scores),
            unk_token=tokens[unknown] if 0 <= unknown < len(tokens) else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    escape = normalizers.Replace(" ", SPACE)
    prefix = fields.get("tokenizer.ggml.add_space_prefix", True)
    tokenizer.normalizer = (
        normalizers.Sequence([normalizers.Prepend(SPACE), escape]) if prefix else escape
    )
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(steps)
    special.add_special_tokens(tokenizer, fields)
    special.set_added_bos_eos(tokenizer, fields, special.adds_bos(fields, by_default=True))
    return tokenizer
