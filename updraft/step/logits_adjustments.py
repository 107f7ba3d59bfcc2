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

from array import array
from collections.abc import Callable
from dataclasses import dataclass

import torch

from updraft.request import Request
from updraft.sampling_params import SamplingParams


@dataclass(frozen=True)
class RowTokens:
    """(row, token) pairs with a value each."""

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
    ``added`` (-inf for bad words and min_tokens' stop tokens, plus logit_bias; repeated
    pairs add up), then ``repetition`` (a penalty p divides a positive logit by p and
    multiplies a negative one; each pair once), then ``subtracted`` (frequency * count +
    presence; repeated pairs add up)."""

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
    banned: list[tuple[int, int]] = []
    added: list[RowTokens] = []
    repeated: list[_Penalised] = []
    counted: list[_Penalised] = []
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
        stops = {*request.eos_token_ids, *params.stop_token_ids}
        for row, position in zip(rows, range(num_rows), strict=True):
            ahead = draft[:position]
            for word in request.bad_words_token_ids:
                if _ends_with(output, ahead, word[:-1]):
                    banned.append((row, word[-1]))
            if len(output) + position < params.min_tokens:
                banned.extend((row, token) for token in stops)
        if params.logit_bias:
            tokens = torch.tensor(list(params.logit_bias), dtype=torch.long)
            values = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32)
            added.append(_every_row(rows, tokens, values))
        if params.repetition_penalty != 1:
            repeated.append((request.token_ids, draft, rows, params))
        if params.frequency_penalty or params.presence_penalty:
            counted.append((output, draft, rows, params))
    if banned:
        rows_t, tokens_t = torch.tensor(banned, dtype=torch.long).unbind(1)
        added.append(RowTokens(rows_t, tokens_t, torch.full((len(banned),), float("-inf"))))
    return LogitsAdjustments(allowed, _cat(added), _repeated(repeated), _counted(counted))


def _ends_with(output: list[int], ahead: list[int], prefix: tuple[int, ...]) -> bool:
    """Whether output followed by ``ahead`` ends with ``prefix``."""
    if not prefix:
        return True
    tail = list(output[-len(prefix) :]) + list(ahead)
    return len(tail) >= len(prefix) and tuple(tail[-len(prefix) :]) == prefix


def _every_row(rows: range, tokens: torch.Tensor, values: torch.Tensor) -> RowTokens:
    """The same (token, value) pairs in each of ``rows``."""
    num_rows = len(rows)
    row_ids = torch.arange(rows.start, rows.stop).repeat_interleave(len(tokens))
    return RowTokens(row_ids, tokens.repeat(num_rows), values.repeat(num_rows))


# (tokens seen before the first row, drafts, the rows, the request's parameters)
_Penalised = tuple[list[int], list[int], range, SamplingParams]
_TOKEN_BITS = 32  # a (request, token) pair as one int64 key


def _distinct(penalised: list[_Penalised]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For all requests at once: each (request, token) among their seen tokens, with how
    often it was seen; one unique over one flat tensor, however many requests."""
    flat, lengths = array("q"), []
    for seen, *_ in penalised:
        flat.extend(seen)
        lengths.append(len(seen))
    tokens = torch.frombuffer(flat, dtype=torch.long) if flat else torch.empty(0, dtype=torch.long)
    owners = torch.arange(len(penalised)).repeat_interleave(torch.tensor(lengths))
    keys, counts = ((owners << _TOKEN_BITS) | tokens).unique(return_counts=True)
    return keys >> _TOKEN_BITS, keys & ((1 << _TOKEN_BITS) - 1), counts


def _in_rows(owner: torch.Tensor, penalised: list[_Penalised]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each entry of request ``owner`` repeated in every one of its rows: (the entry's
    index, its row)."""
    first = torch.tensor([rows.start for _, _, rows, _ in penalised], dtype=torch.long)
    width = torch.tensor([len(rows) for _, _, rows, _ in penalised], dtype=torch.long)
    reps = width[owner]
    entry = torch.arange(len(owner)).repeat_interleave(reps)
    starts = torch.cumsum(reps, 0) - reps
    offset = torch.arange(len(entry)) - starts.repeat_interleave(reps)
    return entry, first[owner].repeat_interleave(reps) + offset


def _repeated(penalised: list[_Penalised]) -> RowTokens:
    """The repetition penalty at every token seen (prompt, output, and the drafts before
    each row), each (row, token) once: the scaled logits are written, not added, so a
    repeat would change nothing but cost a write."""
    if not penalised:
        return RowTokens.empty()
    owner, tokens, _ = _distinct(penalised)
    penalty = torch.tensor([p.repetition_penalty for *_, p in penalised], dtype=torch.float32)
    entry, rows = _in_rows(owner, penalised)
    # A draft seen already is penalised once in every row: only new ones are added.
    drafted = _after_drafts(penalised, lambda p, new: p.repetition_penalty if new else None)
    return _cat([RowTokens(rows, tokens[entry], penalty[owner][entry]), drafted])


def _counted(penalised: list[_Penalised]) -> RowTokens:
    """frequency * count + presence at each token of the output and of the drafts
    before each row; a (row, token) may come more than once, its values add up."""
    if not penalised:
        return RowTokens.empty()
    owner, tokens, counts = _distinct(penalised)
    frequency = torch.tensor([p.frequency_penalty for *_, p in penalised], dtype=torch.float32)
    presence = torch.tensor([p.presence_penalty for *_, p in penalised], dtype=torch.float32)
    values = frequency[owner] * counts.float() + presence[owner]
    entry, rows = _in_rows(owner, penalised)
    drafted = _after_drafts(
        penalised, lambda p, new: p.frequency_penalty + (p.presence_penalty if new else 0.0)
    )
    return _cat([RowTokens(rows, tokens[entry], values[entry]), drafted])


def _after_drafts(
    penalised: list[_Penalised], value: Callable[[SamplingParams, bool], float | None]
) -> RowTokens:
    """Each draft in every row after it, with ``value(params, new)`` (new: not among
    the tokens seen nor the drafts before it); a value of None adds nothing."""
    rows, tokens, values = [], [], []
    for seen, draft, row_range, params in penalised:
        known = set(seen) if draft else set()
        for position, token in enumerate(draft):
            found = value(params, token not in known)
            known.add(token)
            if found is None:
                continue
            later = range(row_range.start + position + 1, row_range.stop)
            rows.extend(later)
            tokens.extend([token] * len(later))
            values.extend([found] * len(later))
    return RowTokens(
        torch.tensor(rows, dtype=torch.long),
        torch.tensor(tokens, dtype=torch.long),
        torch.tensor(values, dtype=torch.float32),
    )


def _cat(parts: list[RowTokens]) -> RowTokens:
    if not parts:
        return RowTokens.empty()
    if len(parts) == 1:
        return parts[0]
    return RowTokens(
        torch.cat([p.rows for p in parts]),
        torch.cat([p.tokens for p in parts]),
        torch.cat([p.values for p in parts]),
    )
