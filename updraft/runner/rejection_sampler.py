"""Verification of draft tokens: greedy matching, or rejection sampling that keeps the
target's distribution exactly.

For a sampled request, draft ``d_i`` drawn from ``q_i`` is accepted with probability
``min(1, p_i(d_i) / q_i(d_i))``, where ``p_i`` is the target distribution after the same
temperature, top-k, top-p and min-p filtering the normal sampler applies. At the first
rejection one token is drawn from ``max(0, p_i - q_i)`` (renormalised) and the rest are
dropped; if every draft is accepted a bonus token is drawn from ``p_k``. Each emitted
token is then distributed exactly as non-speculative sampling would draw it.

Randomness follows the sampler's conventions: a seeded request draws its ``num_drafts``
uniforms, then one Exp(1) noise row of the vocabulary's size, from its own generator, so
its tokens depend neither on the other requests nor on the batch's padded draft width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from updraft.runner.sampler import TopLogprobs, exponential_noise, filtered_probs, top_logprobs
from updraft.sampling_params import SamplingParams
from updraft.step.inputs import SamplingInputs
from updraft.step.sampling_batch import SamplingBatch


@dataclass
class VerifyResult:
    """Per request: the accepted drafts followed by one more token (the correction, or
    the bonus when every draft was accepted)."""

    token_ids: list[list[int]]
    num_accepted: list[int]
    # log_softmax of the raw target logits at each emitted token; None unless asked for.
    logprobs: list[list[float]] | None
    # The likeliest tokens at each emitted token, where some request asked for them.
    top_logprobs: list[list[TopLogprobs]] | None = None


def verify_step(
    logits: torch.Tensor,
    inputs: SamplingInputs,
    generator: torch.Generator | None = None,
    raw_logits: torch.Tensor | None = None,
) -> VerifyResult:
    """Verify the drafts of a step's sampling requests. ``logits`` are the rows at
    ``inputs.logits_indices``: per request, its last known token, then its drafts.
    ``raw_logits``: the model's own, where ``logits`` were masked (for logprobs)."""
    num_drafts = inputs.num_drafts
    widest = max(num_drafts, default=0)
    per_row = 1 + torch.tensor(num_drafts, dtype=torch.long)
    # Row s, position j reads logits row first[s] + min(j, num_drafts[s]): padding
    # positions repeat the request's last row, which verify ignores.
    first = per_row.cumsum(0) - per_row
    positions = torch.minimum(torch.arange(widest + 1)[None], per_row[:, None] - 1)
    index = (first[:, None] + positions).flatten().to(logits.device)
    target_logits = logits.index_select(0, index).view(len(num_drafts), widest + 1, -1)
    raw_target_logits = None
    if raw_logits is not None and inputs.batch.want_logprobs:
        raw_target_logits = raw_logits.index_select(0, index).view(target_logits.shape)
    draft_probs = None
    if any(probs is not None for probs in inputs.draft_probs):
        vocab = logits.shape[-1]
        draft_probs = torch.zeros(len(num_drafts), widest, vocab, device=logits.device)
        for row, (probs, n) in enumerate(zip(inputs.draft_probs, num_drafts, strict=True)):
            if probs is not None:
                draft_probs[row, :n] = probs[:n].to(logits.device)
            else:  # a deterministic draft: q is one-hot at it
                draft_probs[row, torch.arange(n), inputs.draft_token_ids[row, :n]] = 1.0
    return verify(
        target_logits,
        inputs.draft_token_ids,
        num_drafts,
        draft_probs,
        inputs.batch,
        generator,
        raw_target_logits,
    )


def verify(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_drafts: list[int],
    draft_probs: torch.Tensor | None,
    batch: SamplingBatch,
    generator: torch.Generator | None = None,
    raw_target_logits: torch.Tensor | None = None,
) -> VerifyResult:
    """Accept or reject each request's drafts and emit one more token.

    target_logits [B, K+1, V] float32: row b is read at positions 0..num_drafts[b].
    draft_token_ids [B, K]: entries at or beyond num_drafts[b] are padding, of any value.
    num_drafts: per request, 0..K; 0 just samples one token from position 0.
    draft_probs [B, K, V]: the distribution each draft was drawn from, or None for a
    deterministic proposer (then q is one-hot at the draft).
    generator: the randomness of rows that have no generator of their own.
    raw_target_logits: the model's own logits where ``target_logits`` were masked; the
    logprobs are read from them."""
    _check_shapes(target_logits, draft_token_ids, num_drafts, draft_probs)
    batch_size, num_positions, vocab = target_logits.shape
    k = num_positions - 1
    device = target_logits.device

    num_drafts_t = torch.tensor(num_drafts, device=device)
    is_draft = torch.arange(k, device=device)[None] < num_drafts_t[:, None]  # [B, K]
    # Padding may hold ids such as -1 that must not reach a gather.
    drafts = draft_token_ids.to(device).masked_fill(~is_draft, 0)
    target_argmax = target_logits.argmax(dim=-1)  # [B, K+1]
    accepted = drafts == target_argmax[:, :k]

    if not batch.all_greedy:
        # Drawn for every row, in the sampler's order, before anything depends on them.
        uniforms = _uniforms(num_drafts, k, batch, device, generator)
        noise = exponential_noise((batch_size, vocab), batch, device, generator)
        # Filtering sorts the vocabulary at every position, so greedy rows skip it.
        sampled_params = [(b, p) for b, p in enumerate(batch.params) if not p.greedy]
        rows = torch.tensor([b for b, _ in sampled_params], device=device)
        probs = _filtered_probs_per_position(
            target_logits[rows], [p for _, p in sampled_params]
        )  # [S, K+1, V]
        row_drafts = drafts[rows]
        row_draft_probs = None if draft_probs is None else draft_probs.to(device)[rows]
        p_draft = probs[:, :k].gather(-1, row_drafts[..., None])[..., 0]
        if row_draft_probs is None:
            q_draft = torch.ones_like(p_draft)
        else:
            q_draft = row_draft_probs.gather(-1, row_drafts[..., None])[..., 0]
        # u < p/q written without the division: q == 0 (a draft its proposer could not
        # have drawn) accepts whenever p > 0, and p == 0 never accepts.
        accepted[rows] = uniforms[rows] * q_draft < p_draft

    accepted &= is_draft
    num_accepted = accepted.long().cumprod(dim=-1).sum(dim=-1)  # [B]
    final = target_argmax.gather(1, num_accepted[:, None])[:, 0]
    if not batch.all_greedy:
        final[rows] = _draw_last(
            probs, row_drafts, row_draft_probs, num_accepted[rows], num_drafts_t[rows], noise[rows]
        )

    emitted = torch.cat([drafts, final[:, None]], dim=1)
    emitted.scatter_(1, num_accepted[:, None], final[:, None])
    lengths = [n + 1 for n in num_accepted.tolist()]
    token_rows = emitted.tolist()
    token_ids = [row[:n] for row, n in zip(token_rows, lengths, strict=True)]
    logprobs = top = None
    if batch.want_logprobs:
        model = target_logits if raw_target_logits is None else raw_target_logits
        logprobs, top = _emitted_logprobs(model, emitted, lengths, batch.num_top_logprobs)
    return VerifyResult(token_ids, [n - 1 for n in lengths], logprobs, top)


def _check_shapes(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_drafts: list[int],
    draft_probs: torch.Tensor | None,
) -> None:
    batch_size, num_positions, vocab = target_logits.shape
    k = num_positions - 1
    if draft_token_ids.shape != (batch_size, k):
        raise ValueError(
            f"draft_token_ids must have shape {(batch_size, k)} to match target_logits "
            f"{tuple(target_logits.shape)}, got {tuple(draft_token_ids.shape)}"
        )
    if len(num_drafts) != batch_size or not all(0 <= n <= k for n in num_drafts):
        raise ValueError(f"num_drafts must be {batch_size} counts in 0..{k}, got {num_drafts}")
    if draft_probs is not None and draft_probs.shape != (batch_size, k, vocab):
        raise ValueError(
            f"draft_probs must have shape {(batch_size, k, vocab)}, got {tuple(draft_probs.shape)}"
        )


def _emitted_logprobs(
    model_logits: torch.Tensor, emitted: torch.Tensor, lengths: list[int], num_top: int
) -> tuple[list[list[float]], list | None]:
    """Each emitted token's logprob under the model's own logits [B, K+1, V] (and, with
    ``num_top``, the likeliest alternatives at each emitted position)."""
    raw = model_logits.gather(-1, emitted[..., None])[..., 0]
    raw = raw - model_logits.logsumexp(dim=-1)
    logprobs = [row[:n] for row, n in zip(raw.tolist(), lengths, strict=True)]
    if not num_top:
        return logprobs, None
    num_positions = model_logits.shape[1]
    flat = top_logprobs(model_logits.flatten(0, 1), num_top)
    top = [flat[b * num_positions : b * num_positions + n] for b, n in enumerate(lengths)]
    return logprobs, top


def sample_draft(
    logits: torch.Tensor, batch: SamplingBatch, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A draft model's proposal at one position: logits [B, V] -> (token ids [B], the
    distribution q [B, V] they were drawn from, or None when every row is greedy).

    q is filtered like the target, so that p/q compares like with like; greedy rows take
    the argmax and their q is one-hot at it.
    """
    greedy = logits.argmax(dim=-1)
    if batch.all_greedy:
        return greedy, None
    probs = filtered_probs(logits, batch)
    noise = exponential_noise(probs.shape, batch, probs.device, generator)
    sampled = (probs / noise).argmax(dim=-1)
    greedy_rows = (batch.temperature == 0).to(logits.device)
    tokens = torch.where(greedy_rows, greedy, sampled)
    one_hot = torch.nn.functional.one_hot(greedy, logits.shape[-1]).to(probs.dtype)
    return tokens, torch.where(greedy_rows[:, None], one_hot, probs)


def _filtered_probs_per_position(
    logits: torch.Tensor, params: list[SamplingParams]
) -> torch.Tensor:
    num_rows, num_positions, vocab = logits.shape
    per_position = [p for p in params for _ in range(num_positions)]
    batch = SamplingBatch(per_position, [None] * len(per_position))
    probs = filtered_probs(logits.reshape(-1, vocab), batch)
    return probs.view(num_rows, num_positions, vocab)


def _draw_last(
    probs: torch.Tensor,
    drafts: torch.Tensor,
    draft_probs: torch.Tensor | None,
    num_accepted: torch.Tensor,
    num_drafts: torch.Tensor,
    noise: torch.Tensor,
) -> torch.Tensor:
    """The token after the accepted drafts of sampled rows: drawn from max(0, p - q) at a
    rejection, from p when every draft was accepted."""
    rows = torch.arange(len(probs), device=probs.device)
    last_probs = probs[rows, num_accepted]  # [S, V]
    k = drafts.shape[1]
    if k > 0:
        at = num_accepted.clamp(max=k - 1)
        if draft_probs is None:
            residual = last_probs.scatter(-1, drafts[rows, at][:, None], 0.0)
        else:
            residual = (last_probs - draft_probs[rows, at]).clamp_min(0.0)
        # Mass zero means q >= p everywhere, which a rejection only meets through
        # rounding or an unnormalised q: p itself is the only sensible draw then.
        use_residual = (num_accepted < num_drafts) & (residual.sum(dim=-1) > 0)
        last_probs = torch.where(use_residual[:, None], residual, last_probs)
    # The exponential race draws in proportion to the weights, so the residual needs no
    # normalising (exponential_noise keeps 0 / 0 out of the argmax).
    return (last_probs / noise).argmax(dim=-1)


def _uniforms(
    num_drafts: list[int],
    k: int,
    batch: SamplingBatch,
    device: torch.device,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """U[0, 1) per draft; a seeded row draws exactly its num_drafts from its own generator."""
    uniforms = torch.rand((len(num_drafts), k), device=device, generator=generator)
    for row, own in enumerate(batch.generators):
        if own is not None and num_drafts[row] > 0:
            drawn = torch.rand(num_drafts[row], device=own.device, generator=own)
            uniforms[row, : num_drafts[row]] = drawn.to(device)
    return uniforms
