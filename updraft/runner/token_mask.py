"""Constrained decoding's one op on the logits: tokens a row's grammar forbids get -inf,
before any filtering or sampling, outside the captured graph. On the CPU a C kernel
(``kernels/token_mask.c``) does it in place on a copy, reading each bitmask word once;
elsewhere, tensor ops unpack the bits."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from updraft.kernels.build import kernel_builds
from updraft.kernels.ops import mask_logits_
from updraft.step.allowed_tokens import AllowedTokens
from updraft.step.inputs import SamplingInputs
from updraft.step.sampling_batch import SamplingBatch

# After its forward a step waits for its masks while each finishes within this fraction
# of the forward's time of the last (between the floor and the cap), and no longer than
# the forward took in all: a quick mask always fits, a late one costs its request a
# step, and a long wait would cost every stream one. A step then takes at most about
# twice its forward, whatever a grammar costs.
MASK_WAIT_RATIO = 0.5
MASK_WAIT_FLOOR_SECONDS = 0.0005
MASK_WAIT_CAP_SECONDS = 0.005

# The value of each bit of an int32 word (bit 31's is the sign bit, -2**31).
_BIT_VALUES = torch.tensor([1 << bit for bit in range(31)] + [-(1 << 31)], dtype=torch.int32)


def mask_wait(forward_seconds: float) -> tuple[float, float]:
    """How long a step whose forward took ``forward_seconds`` waits for its next mask,
    and for all of them."""
    quiet = min(
        MASK_WAIT_CAP_SECONDS, max(MASK_WAIT_FLOOR_SECONDS, MASK_WAIT_RATIO * forward_seconds)
    )
    return quiet, max(quiet, forward_seconds)


@contextmanager
def own_randomness_kept(batch: SamplingBatch, allowed: AllowedTokens | None) -> Iterator[None]:
    """Sampling in which the requests whose masks were late leave their own generators
    as they were: their tokens are dropped, so a seeded request's text stays the same
    whenever its masks are late."""
    late = () if allowed is None else allowed.late
    kept = [(g, g.get_state()) for g in (batch.generators[i] for i in late) if g is not None]
    yield
    for generator, state in kept:
        generator.set_state(state)


def mask_logits(
    logits: torch.Tensor, allowed: AllowedTokens, in_place: bool = False
) -> torch.Tensor:
    """``logits`` [rows, vocab] float32 with every token ``allowed`` forbids in its rows
    set to -inf: a new tensor, or ``logits`` itself with ``in_place`` (when nothing reads
    the model's own logits after)."""
    if not len(allowed.rows):
        return logits if in_place else logits.clone()
    if logits.device.type == "cpu" and kernel_builds("token_mask") and logits.is_contiguous():
        masked = logits if in_place else logits.clone()
        mask_logits_(masked, allowed.rows, allowed.bitmask.contiguous())
        return masked
    return unpacked_mask_logits(logits, allowed)


def unpacked_mask_logits(logits: torch.Tensor, allowed: AllowedTokens) -> torch.Tensor:
    """The same with tensor ops, on any device."""
    device = logits.device
    rows = allowed.rows.to(device)
    bits = allowed.bitmask.to(device)
    keep = (bits.unsqueeze(-1) & _BIT_VALUES.to(device)).ne(0).flatten(1)
    vocab = logits.shape[1]
    width = min(vocab, keep.shape[1])
    constrained = torch.full((len(rows), vocab), float("-inf"), device=device)
    constrained[:, :width] = logits.index_select(0, rows)[:, :width].where(
        keep[:, :width], float("-inf")
    )
    return logits.index_copy(0, rows, constrained)


def no_token_allowed(
    logits: torch.Tensor,
    sampling: SamplingInputs,
    num_accepted: list[int],
    request_ids: list[str],
    masked: bool,
) -> frozenset[str]:
    """The requests whose row at their last emitted token, after their accepted drafts,
    allows no token at all (every logit -inf), as only a grammar's mask (``masked``)
    and the requests' adjustments can make it."""
    if not masked and sampling.adjustments.empty:
        return frozenset()
    per_request = torch.tensor(sampling.num_drafts, dtype=torch.long) + 1
    first = per_request.cumsum(0) - per_request
    rows = (first + torch.tensor(num_accepted, dtype=torch.long)).to(logits.device)
    empty = torch.isneginf(logits.index_select(0, rows)).all(dim=-1)
    return frozenset(request_ids[index] for index in empty.nonzero().flatten().tolist())
