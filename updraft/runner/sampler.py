"""Batched sampling: greedy, temperature, top-k, top-p and min-p, with per-request seeds.

Sampling is an exponential race, ``argmax(probs / noise)`` with noise ~ Exp(1), which
draws exactly from ``probs``. A seeded request draws its noise row from its own generator
with a shape that does not depend on the batch, so its text does not either.
"""

from __future__ import annotations

import torch

from updraft.step.prompt_rows import PromptRows
from updraft.step.sampling_batch import SamplingBatch


def filtered_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The distribution each row samples from: temperature, then top-k, top-p, min-p."""
    temperature = batch.temperature.to(logits.device)
    logits = logits / torch.where(temperature > 0, temperature, 1.0)[:, None]
    if batch.use_top_k or batch.use_top_p:
        logits = _top_k_top_p(logits, batch)
    probs = logits.softmax(dim=-1)
    if batch.use_min_p:
        min_p = batch.min_p.to(logits.device)[:, None]
        probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


# Top-p looks at the largest logits first, and sorts the whole vocabulary only when some
# row's nucleus reaches past them: a full sort at every row of a batch, or every verify
# position, costs more than the forward on a CPU.
TOP_P_CANDIDATES = 1024


def _top_k_top_p(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    if not batch.use_top_p:
        return _top_k(logits, batch)
    vocab = logits.shape[-1]
    width = max(min(TOP_P_CANDIDATES, vocab), int(batch.top_k.clamp(max=vocab).max()))
    filtered = _nucleus(logits, batch, width)
    return filtered if filtered is not None else _nucleus(logits, batch, vocab)


def _nucleus(logits: torch.Tensor, batch: SamplingBatch, width: int) -> torch.Tensor | None:
    """Top-k and top-p over each row's ``width`` largest logits; None when a row's
    nucleus may reach past them (then ``width`` must be the vocabulary)."""
    device = logits.device
    vocab = logits.shape[-1]
    top_k = batch.top_k.to(device).clamp(max=vocab)
    top_p = batch.top_p.to(device)
    sorted_logits, order = logits.topk(width, dim=-1)
    ranks = torch.arange(width, device=device)
    drop = ranks[None] >= torch.where(top_k > 0, top_k, vocab)[:, None]
    kept = sorted_logits.masked_fill(drop, float("-inf"))
    # A row with top-k keeps only candidates (width covers every k); one without it
    # normalises over the whole vocabulary.
    probs = torch.where(
        (top_k > 0)[:, None], kept.softmax(dim=-1), logits.softmax(dim=-1).gather(-1, order)
    )
    mass_before = probs.cumsum(dim=-1) - probs
    # Keep the smallest prefix whose mass reaches top_p; the top token always stays, even
    # for a top_p so small (1e-300) that it is 0 in float32.
    drop |= (mass_before >= top_p[:, None]) & (ranks[None] > 0)
    untouched = (top_p >= 1) & (top_k == 0)
    if width < vocab:
        # Tokens past the candidates are dropped only if the candidates reach top_p.
        covered = untouched | (top_k > 0) | (probs.sum(dim=-1) >= top_p)
        if not bool(covered.all()):
            return None
    filtered = torch.full_like(logits, float("-inf"))
    filtered.scatter_(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.where(untouched[:, None], logits, filtered)


def _top_k(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Top-k alone needs no full sort: keep what reaches each row's k-th largest logit
    (``topk`` over the largest k of the batch is far cheaper than sorting the vocabulary
    at every verify position)."""
    vocab = logits.shape[-1]
    largest = logits.topk(int(batch.top_k.clamp(max=vocab).max()), dim=-1).values
    top_k = batch.top_k.to(logits.device).clamp(max=vocab)
    on = top_k > 0
    kth = largest.gather(-1, (top_k - 1).clamp(min=0)[:, None])
    kth = torch.where(on[:, None], kth, float("-inf"))
    return logits.masked_fill(logits < kth, float("-inf"))


def exponential_noise(
    shape: tuple[int, int],
    batch: SamplingBatch,
    device: torch.device,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Exp(1) noise; unseeded rows share ``generator``, seeded rows use their own.
    Clamped away from 0, so ``probs / noise`` never divides 0 by 0."""
    noise = torch.empty(shape, device=device).exponential_(generator=generator)
    for row, generator in enumerate(batch.generators):
        if generator is not None:
            noise[row] = torch.empty(shape[1]).exponential_(generator=generator).to(device)
    return noise.clamp_(min=torch.finfo(noise.dtype).tiny)


TopLogprobs = list[dict[int, float]]  # per token: the likeliest tokens and their logprobs


def top_logprobs(
    model_logits: torch.Tensor, k: int, normalizer: torch.Tensor | None = None
) -> list[TopLogprobs]:
    """[N, V] -> per row, the k likeliest tokens and their log-probabilities
    (``normalizer``: the rows' logsumexp [N, 1], where the caller has it)."""
    if normalizer is None:
        normalizer = model_logits.logsumexp(dim=-1, keepdim=True)
    values, ids = model_logits.topk(k, dim=-1)
    values = values - normalizer
    return [
        dict(zip(row_ids, row_values, strict=True))
        for row_ids, row_values in zip(ids.tolist(), values.tolist(), strict=True)
    ]


PromptLogprobs = dict[str, tuple[int, list[dict[int, float]]]]


def prompt_logprobs(logits: torch.Tensor, rows: PromptRows) -> PromptLogprobs:
    """Per request of ``rows``: the prompt position its first row scores, and for each
    row the scored prompt token's log-probability followed by the likeliest tokens'
    (``logits`` [len(rows), V], the model's own)."""
    normalizer = logits.logsumexp(dim=-1, keepdim=True)
    scored = (logits.gather(-1, rows.targets[:, None].to(logits.device)) - normalizer)[:, 0]
    k = max(rows.top)
    likeliest = top_logprobs(logits, k, normalizer) if k else None
    targets, scored = rows.targets.tolist(), scored.tolist()
    out: PromptLogprobs = {}
    start = 0
    for request_id, first, count, top in zip(
        rows.request_ids, rows.first_positions, rows.counts, rows.top, strict=True
    ):
        entries = []
        for row in range(start, start + count):
            entry = {targets[row]: scored[row]}
            if top:  # the step's rows hold its largest ask, likeliest first
                for token, value in list(likeliest[row].items())[:top]:
                    entry.setdefault(token, value)
            entries.append(entry)
        out[request_id] = (first, entries)
        start += count
    return out


def sample(
    logits: torch.Tensor,
    batch: SamplingBatch,
    generator: torch.Generator | None = None,
    raw_logits: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, list[TopLogprobs] | None]:
    """logits [B, V] float32 -> (token ids [B], logprobs of those tokens under the raw
    model distribution, ``raw_logits`` where given, or None when no request asked for
    them; the top ``batch.num_top_logprobs`` of that distribution per row, or None)."""
    greedy = logits.argmax(dim=-1)
    if batch.all_greedy:
        tokens = greedy
    else:
        probs = filtered_probs(logits, batch)
        noise = exponential_noise(probs.shape, batch, probs.device, generator)
        sampled = (probs / noise).argmax(dim=-1)
        tokens = torch.where(batch.temperature.to(logits.device) > 0, sampled, greedy)
    logprobs = top = None
    if batch.want_logprobs:
        raw = logits if raw_logits is None else raw_logits
        logprobs = raw.log_softmax(dim=-1).gather(-1, tokens[:, None])[:, 0]
        if batch.num_top_logprobs:
            top = top_logprobs(raw, batch.num_top_logprobs)
    return tokens, logprobs, top
