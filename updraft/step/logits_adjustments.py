"""What a step's requests change in their logits before sampling: allowed tokens, bad
words, min_tokens, logit_bias and the penalties, as index tensors over the step's
logits rows.

A request's rows are its last known token, then each of its drafts. The row after
draft ``j`` sees the output as it would be had drafts ``0..j`` been accepted: the
penalties count them, a bad word may end in them, min_tokens counts them. So the
rejection sampler verifies every draft against the distribution plain sampling would
have used at that position, and speculation stays exact.

Everything here is index work per request (never per vocabulary entry); the runner
applies it with a handful of batched tensor ops (``runner/logits_processors.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from updraft.request import Request
from updraft.sampling_params import SamplingParams

# A (row, token) pair as one int64, so that torch.unique can merge repeats.
_ROW_STRIDE = 1 << 32


@dataclass(frozen=True)
class RowTokens:
    """(row, token) pairs with one value each, no pair twice."""

    rows: torch.Tensor  # int64
    tokens: torch.Tensor  # int64
    values: torch.Tensor  # float32

    @classmethod
    def empty(cls) -> RowTokens:
        nothing = torch.empty(0, dtype=torch.long)
        return cls(nothing, nothing, torch.empty(0))

    def __len__(self) -> int:
        return len(self.rows)


@dataclass(frozen=True)
class LogitsAdjustments:
    """Applied in this order (vLLM's): ``allowed`` (rows limited to these tokens), then
    ``added`` (-inf for bad words and min_tokens' stop tokens, plus logit_bias), then
    ``repetition`` (a penalty p divides a positive logit by p and multiplies a negative
    one), then ``subtracted`` (frequency * count + presence)."""

    allowed: list[tuple[torch.Tensor, torch.Tensor]]  # (rows, token ids) per request
    added: RowTokens
    repetition: RowTokens
    subtracted: RowTokens

    @property
    def empty(self) -> bool:
        return not (self.allowed or self.added or self.repetition or self.subtracted)


NO_ADJUSTMENTS = LogitsAdjustments([], RowTokens.empty(), RowTokens.empty(), RowTokens.empty())


def logits_adjustments(requests: list[Request], drafts: list[list[int]]) -> LogitsAdjustments:
    """The adjustments of a step's sampling requests, each with the draft tokens it
    carries (its rows are ``1 + len(drafts)``, in request order)."""
    if not any(r.sampling_params.adjusts_logits for r in requests):
        return NO_ADJUSTMENTS
    allowed = []
    added: list[tuple[int, int, float]] = []
    repeated, counted = [], []
    first_row = 0
    for request, draft in zip(requests, drafts, strict=True):
        params = request.sampling_params
        num_rows = 1 + len(draft)
        rows = range(first_row, first_row + num_rows)
        first_row += num_rows
        if not params.adjusts_logits:
            continue
        output = request.token_ids[request.num_prompt_tokens :]
        if params.allowed_token_ids is not None:
            ids = torch.tensor(params.allowed_token_ids, dtype=torch.long)
            allowed.append((torch.tensor(rows, dtype=torch.long), ids))
        for row, position in zip(rows, range(num_rows), strict=True):
            ahead = draft[:position]
            for word in request.bad_words_token_ids:
                if _ends_with(output, ahead, word[:-1]):
                    added.append((row, word[-1], float("-inf")))
            if len(output) + position < params.min_tokens:
                stops = {*request.eos_token_ids, *params.stop_token_ids}
                added.extend((row, token, float("-inf")) for token in stops)
            if params.logit_bias:
                added.extend((row, token, bias) for token, bias in params.logit_bias.items())
        if params.repetition_penalty != 1:
            seen = torch.tensor(request.token_ids, dtype=torch.long).unique()
            repeated.append(_per_row(seen, draft, rows, params.repetition_penalty))
        if params.frequency_penalty or params.presence_penalty:
            counted.append(_counted(output, draft, rows, params))
    return LogitsAdjustments(
        allowed, _merged_added(added), _merged(repeated, keep="first"), _merged(counted)
    )


def _ends_with(output: list[int], ahead: list[int], prefix: tuple[int, ...]) -> bool:
    """Whether output followed by ``ahead`` ends with ``prefix``."""
    if not prefix:
        return True
    tail = list(output[-len(prefix) :]) + list(ahead)
    return len(tail) >= len(prefix) and tuple(tail[-len(prefix) :]) == prefix


def _per_row(seen: torch.Tensor, draft: list[int], rows: range, value: float) -> RowTokens:
    """``value`` at every token of ``seen`` in each row, and at draft ``i`` in the rows
    after it; pairs may repeat (merged later)."""
    num_rows = len(rows)
    row_ids = torch.arange(rows.start, rows.stop).repeat_interleave(len(seen))
    tokens = seen.repeat(num_rows)
    if draft:
        later, earlier = torch.tril_indices(num_rows, num_rows, offset=-1)
        row_ids = torch.cat([row_ids, later + rows.start])
        tokens = torch.cat([tokens, torch.tensor(draft, dtype=torch.long)[earlier]])
    return RowTokens(row_ids, tokens, torch.full((len(tokens),), float(value)))


def _counted(output: list[int], draft: list[int], rows: range, params: SamplingParams) -> RowTokens:
    """frequency * count + presence at each token of the output (with the drafts before
    each row), as one value per (row, token)."""
    tokens, counts = torch.tensor(output, dtype=torch.long).unique(return_counts=True)
    once = _per_row(tokens, draft, rows, 1.0)
    counts = torch.cat([counts.float().repeat(len(rows)), once.values[len(rows) * len(tokens) :]])
    keys, inverse = (once.rows * _ROW_STRIDE + once.tokens).unique(return_inverse=True)
    total = torch.zeros(len(keys)).index_add_(0, inverse, counts)
    values = params.frequency_penalty * total + params.presence_penalty
    return RowTokens(keys // _ROW_STRIDE, keys % _ROW_STRIDE, values)


def _merged(parts: list[RowTokens], keep: str = "sum") -> RowTokens:
    """Parts from different requests (whose rows never overlap) as one; with ``keep``
    "first", repeated pairs within a part keep one value (all equal)."""
    if not parts:
        return RowTokens.empty()
    rows = torch.cat([p.rows for p in parts])
    tokens = torch.cat([p.tokens for p in parts])
    values = torch.cat([p.values for p in parts])
    if keep == "first":
        keys, inverse = (rows * _ROW_STRIDE + tokens).unique(return_inverse=True)
        first = torch.full((len(keys),), 0.0).scatter_(0, inverse, values)
        return RowTokens(keys // _ROW_STRIDE, keys % _ROW_STRIDE, first)
    return RowTokens(rows, tokens, values)


def _merged_added(added: list[tuple[int, int, float]]) -> RowTokens:
    """Additive entries summed per (row, token): a biased token that is also banned
    stays -inf."""
    if not added:
        return RowTokens.empty()
    rows, tokens, values = zip(*added, strict=True)
    rows_t = torch.tensor(rows, dtype=torch.long)
    tokens_t = torch.tensor(tokens, dtype=torch.long)
    keys, inverse = (rows_t * _ROW_STRIDE + tokens_t).unique(return_inverse=True)
    total = torch.zeros(len(keys)).index_add_(0, inverse, torch.tensor(values, dtype=torch.float32))
    return RowTokens(keys // _ROW_STRIDE, keys % _ROW_STRIDE, total)
