"""A Gated DeltaNet layer (Qwen3.5, Qwen3-Next): linear attention over a per-request
state instead of a KV cache.

The layer projects each token to q/k/v channels, a gate z and per value head a write
rate b and a decay a; q/k/v pass a short causal convolution, then the gated delta rule
(``delta_rule.py``) runs over them; its output is RMS-normed per head, gated by
silu(z) and projected back.

The state (engine-allocated, one tensor per layer ``[slots + 1, depth, width]``) holds
per request and row the convolution's window (``[conv_dim, conv_kernel - 1]``, oldest
token first) then the recurrent state ``[value_heads, key_head_dim, value_head_dim]``.
The state after the token at position p is row ``p % depth``: a query over positions
start .. end - 1 starts from row ``(start - 1) % depth`` (zeros when start is 0), and
a query of at most ``depth`` tokens runs token by token and writes every token's state
(a verify step leaves one per draft; the next step reads only the accepted one's),
while a longer one runs the chunked form and writes only its last state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from updraft.attention.metadata import AttentionMetadata
from updraft.model_config import ModelConfig
from updraft.models import delta_rule
from updraft.models.layers import FusedLinear


class GatedRMSNorm(nn.Module):
    """RMSNorm per head (plain weight) times silu(gate), the gate in float32."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)
        return (self.weight * normed * F.silu(gate.float())).to(x.dtype)


class ConvWeight(nn.Module):
    """The depthwise convolution's weight, [conv_dim, 1, kernel] as checkpoints hold it."""

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(channels, 1, kernel))


class GatedDeltaNet(nn.Module):
    def __init__(self, config: ModelConfig, interleaved: bool = False) -> None:
        """``interleaved``: Qwen3-Next's projections, q/k/v/z and b/a stored per key head
        (``in_proj_qkvz``, ``in_proj_ba``); else Qwen3.5's, fused here into ``in_proj``."""
        super().__init__()
        linear = config.linear_attention
        self.linear = linear
        self.interleaved = interleaved
        hidden, heads = config.hidden_size, linear.num_value_heads
        if interleaved:
            self.in_proj_qkvz = nn.Linear(hidden, linear.conv_dim + linear.value_dim, bias=False)
            self.in_proj_ba = nn.Linear(hidden, 2 * heads, bias=False)
        else:
            self.projection_sizes = [linear.conv_dim, linear.value_dim, heads, heads]
            self.in_proj = FusedLinear(hidden, self.projection_sizes, bias=False)
        self.conv1d = ConvWeight(linear.conv_dim, linear.conv_kernel)
        self.dt_bias = nn.Parameter(torch.ones(heads))
        self.A_log = nn.Parameter(torch.zeros(heads))
        self.norm = GatedRMSNorm(linear.value_head_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(linear.value_dim, hidden, bias=False)

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """[T, hidden] -> the conv channels (q, k, v) [T, conv_dim], z [T, value_dim],
        b and a [T, value_heads], in Qwen3.5's order whichever layout the weights have."""
        linear = self.linear
        if not self.interleaved:
            return self.in_proj(hidden).split(self.projection_sizes, dim=-1)
        tokens, groups = hidden.shape[0], linear.num_key_heads
        per_group = linear.num_value_heads // groups
        value_width = per_group * linear.value_head_dim
        qkvz = self.in_proj_qkvz(hidden).view(tokens, groups, -1)
        q, k, v, z = qkvz.split([linear.key_head_dim] * 2 + [value_width] * 2, dim=-1)
        b, a = self.in_proj_ba(hidden).view(tokens, groups, 2 * per_group).chunk(2, dim=-1)
        mixed = torch.cat([x.reshape(tokens, -1) for x in (q, k, v)], dim=-1)
        return mixed, z.reshape(tokens, -1), b.reshape(tokens, -1), a.reshape(tokens, -1)

    def forward(
        self,
        hidden: torch.Tensor,
        state: torch.Tensor,
        state_slots: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """[T, hidden] -> [T, hidden], reading and writing each request's rows of
        ``state`` (``state_slots[r]`` is request r's slot)."""
        if metadata.query_len is None and not metadata.query_lens:
            raise ValueError(
                "a linear-attention layer needs the step's query lengths: metadata.query_len "
                "(a uniform step) or metadata.query_lens (an eager one)"
            )
        mixed, z, b, a = self.project(hidden)
        inputs = (mixed.float(), b.float(), a.float())
        # The runs' outputs joined, not written into a buffer made here: a captured
        # graph takes a tensor made from nothing for a constant, and what reads it
        # would not be replayed.
        pieces, covered = [], 0
        for first, last, query_len, tokens in _runs(metadata, state_slots.numel(), state.shape[1]):
            part = [x[tokens].view(last - first, query_len, -1) for x in inputs]
            ends = metadata.seq_lens[first:last]
            pieces.append(self._run(state, state_slots[first:last], ends, *part).flatten(0, 1))
            covered = tokens.stop
        if covered < hidden.shape[0] or not pieces:  # a bucket's padding tokens
            pieces.append(inputs[0].new_zeros(hidden.shape[0] - covered, self.linear.value_dim))
        out = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        heads = out.view(hidden.shape[0], -1, self.linear.value_head_dim).to(hidden.dtype)
        gated = self.norm(heads, z.view_as(heads))
        return self.out_proj(gated.flatten(1))

    def _run(
        self,
        cache: torch.Tensor,
        slots: torch.Tensor,
        ends: torch.Tensor,
        mixed: torch.Tensor,
        b: torch.Tensor,
        a: torch.Tensor,
    ) -> torch.Tensor:
        """Requests of one query length (float32): mixed [R, Q, conv_dim], b and a
        [R, Q, heads] -> the core output [R, Q, value_dim]."""
        requests, query_len = mixed.shape[:2]
        depth = cache.shape[1]
        starts = ends - query_len
        window, memory = self.initial_states(cache, slots, starts)
        weight = self.conv1d.weight.float()[:, 0]
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a + self.dt_bias.float())
        if not token_by_token(query_len, depth):
            conv, window = delta_rule.causal_conv(mixed, window, weight)
            q, k, v = self._heads(conv)
            core, memory = delta_rule.chunked(
                *(x.transpose(1, 2) for x in (q, k, v, g, beta)), memory
            )
            self.store_states(cache, slots, ends - 1, window, memory)
            return core.transpose(1, 2).reshape(requests, query_len, -1)
        outputs = []
        for t in range(query_len):
            conv, window = delta_rule.causal_conv(mixed[:, t : t + 1], window, weight)
            q, k, v = (x[:, 0] for x in self._heads(conv))
            core, memory = delta_rule.recurrent_step(q, k, v, g[:, t], beta[:, t], memory)
            self.store_states(cache, slots, starts + t, window, memory)
            outputs.append(core.reshape(requests, -1))
        return torch.stack(outputs, dim=1)

    def _heads(self, conv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """conv [R, T, conv_dim] -> q, k [R, T, value_heads, Dk] (normalised, q scaled;
        each key head repeated for the value heads it serves) and v [R, T, value_heads, Dv]."""
        linear = self.linear
        requests, tokens = conv.shape[:2]
        q, k, v = conv.split([linear.key_dim, linear.key_dim, linear.value_dim], dim=-1)
        repeat = linear.num_value_heads // linear.num_key_heads
        q, k = (
            delta_rule.l2norm(
                x.reshape(requests, tokens, linear.num_key_heads, -1)
            ).repeat_interleave(repeat, dim=2)
            for x in (q, k)
        )
        q = q * linear.key_head_dim**-0.5
        return q, k, v.reshape(requests, tokens, linear.num_value_heads, -1)

    def initial_states(
        self, cache: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each request's window [R, C, K - 1] and state [R, H, Dk, Dv] before its query:
        the row of the token before it, or zeros for a query from position 0 on."""
        linear = self.linear
        rows = (
            cache.view(-1, cache.shape[-1])
            .index_select(0, _row_index(cache, slots, starts - 1))
            .float()
        )
        rows = torch.where((starts > 0)[:, None], rows, torch.zeros_like(rows))
        split = linear.conv_dim * (linear.conv_kernel - 1)
        window = rows[:, :split].view(-1, linear.conv_dim, linear.conv_kernel - 1)
        memory = rows[:, split:].view(
            -1, linear.num_value_heads, linear.key_head_dim, linear.value_head_dim
        )
        return window, memory

    @staticmethod
    def store_states(
        cache: torch.Tensor,
        slots: torch.Tensor,
        positions: torch.Tensor,
        window: torch.Tensor,
        memory: torch.Tensor,
    ) -> None:
        values = torch.cat([window.flatten(1), memory.flatten(1)], dim=1)
        cache.view(-1, cache.shape[-1]).index_copy_(
            0, _row_index(cache, slots, positions), values.to(cache.dtype)
        )


def token_by_token(query_len: int, depth: int) -> bool:
    """Whether a query of ``query_len`` tokens runs the recurrence token by token,
    keeping the state after each of its tokens (decodes and verify steps: at most
    ``depth`` tokens), rather than in the chunked form, which keeps only the state after
    its last token (prefill chunks). A verify step must keep each: the next step starts
    from the state after its last accepted draft."""
    return query_len <= depth


def _row_index(cache: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Where the state after each request's token at ``positions`` lives in ``cache``
    seen as [slots * depth, width]: its slot's row ``position % depth`` (slot -1, a
    padded request's, is the spare last one). Index ops only: a graph can hold them."""
    num_slots, depth = cache.shape[:2]
    return slots.remainder(num_slots) * depth + positions.remainder(depth)


def _runs(metadata: AttentionMetadata, num_requests: int, depth: int):
    """(first request, last request, query length, token slice) for each run of requests
    that run together: the whole bucket where every query has one length, else each run
    of equal-length queries of at most ``depth`` tokens (token by token, batched as a
    graph's bucket is), and each longer query alone."""
    if metadata.query_len is not None:
        query_len = metadata.query_len
        yield 0, num_requests, query_len, slice(0, num_requests * query_len)
        return
    lens = metadata.query_lens
    first, token = 0, 0
    while first < len(lens):
        query_len = lens[first]
        last = first + 1
        while last < len(lens) and lens[last] == query_len and token_by_token(query_len, depth):
            last += 1
        if query_len > 0:
            yield first, last, query_len, slice(token, token + (last - first) * query_len)
        token += (last - first) * query_len
        first = last
