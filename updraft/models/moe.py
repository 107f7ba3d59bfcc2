"""DeepSeekMoE: a router with group-limited top-k, routed experts and shared ones.

V3's router scores every expert with a sigmoid. For choosing experts only, each score
gets the checkpoint's ``e_score_correction_bias``; the experts fall into ``n_group``
groups, a group is worth the sum of its two best corrected scores, and the top-k
experts are chosen among the ``topk_group`` best groups. The chosen experts' weights are
their uncorrected scores, normalised to sum to 1 (``norm_topk_prob``), times
``routed_scaling_factor``. V2's router is the same with a softmax, no bias, groups
worth their best score, and no normalising. The shared experts see every token.

Routed experts cost the tokens routed to them, not every expert for every token: the
(token, expert) pairs are sorted by expert and ``updraft::grouped_mlp`` streams each
chosen expert's weights once over its rows. Every shape is fixed by the token count
(top-k rows per token), so a captured graph can hold the whole layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from updraft.config import MoEConfig
from updraft.kernels.ops import kernel_builds
from updraft.models.layers import MLP


class TopKRouter(nn.Module):
    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        # float32 whatever the compute dtype, as the reference keeps them: rounding the
        # router's scores or bias to bfloat16 would change which experts win.
        self.weight = nn.Parameter(
            torch.zeros(config.num_experts, config.hidden_size, dtype=torch.float32)
        )
        # A parameter, not a buffer: checkpoints carry it, and the loader fills parameters.
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(config.num_experts, dtype=torch.float32))
            if config.scoring == "sigmoid"
            else None
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] float32, experts [T, k] int64)."""
        config = self.config
        logits = F.linear(x.float(), self.weight.float())
        if config.scoring == "softmax":
            scores = biased = logits.softmax(dim=-1)
        else:
            scores = logits.sigmoid()
            biased = scores + self.e_score_correction_bias
        per_group = biased.view(-1, config.n_group, config.num_experts // config.n_group)
        if config.group_score == "max":
            group_scores = per_group.amax(dim=-1)
        else:
            group_scores = per_group.topk(2, dim=-1).values.sum(dim=-1)
        best_groups = group_scores.topk(config.topk_group, dim=-1).indices
        in_best = torch.zeros_like(group_scores).scatter(1, best_groups, 1.0).bool()
        allowed = in_best[:, :, None].expand_as(per_group).reshape(-1, config.num_experts)
        experts = biased.masked_fill(~allowed, float("-inf")).topk(
            config.num_experts_per_tok, dim=-1
        )[1]
        weights = scores.gather(1, experts)
        if config.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * config.routed_scaling_factor, experts


class Experts(nn.Module):
    """Every routed expert's weights, stacked: gate_up_proj [E, 2I, H] (gate rows, then
    up rows) and down_proj [E, H, I]."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        size, hidden = config.moe_intermediate_size, config.hidden_size
        self.gate_up_proj = nn.Parameter(torch.zeros(config.num_experts, 2 * size, hidden))
        self.down_proj = nn.Parameter(torch.zeros(config.num_experts, hidden, size))

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor:
        num_experts, k = self.gate_up_proj.shape[0], experts.shape[1]
        chosen = experts.flatten()
        order = torch.argsort(chosen, stable=True)  # (token, expert) pairs by expert
        token_of_row = order // k
        rows = x.index_select(0, token_of_row)
        if x.dtype == torch.float32 and x.device.type == "cpu" and kernel_builds("moe"):
            counts = torch.zeros(num_experts, dtype=torch.int64).scatter_add(
                0, chosen, torch.ones_like(chosen)
            )
            offsets = F.pad(counts.cumsum(0), (1, 0))
            rows = torch.ops.updraft.grouped_mlp(rows, offsets, self.gate_up_proj, self.down_proj)
        else:
            rows = self._per_row(rows, chosen.index_select(0, order))
        rows = rows * weights.flatten().index_select(0, order)[:, None].to(rows.dtype)
        return torch.zeros_like(x).index_add(0, token_of_row, rows)

    def _per_row(self, rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Where the kernel does not run (other devices and dtypes): each row through its
        expert's weights, gathered per row. Correct and capturable (no shape depends on
        the routing), but it copies each row's weights: a fallback, not a fast path."""
        gate, up = torch.bmm(self.gate_up_proj.index_select(0, experts), rows[:, :, None]).chunk(
            2, dim=1
        )
        hidden = F.silu(gate) * up
        return torch.bmm(self.down_proj.index_select(0, experts), hidden)[:, :, 0]


class DeepseekMoE(nn.Module):
    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.gate = TopKRouter(config)
        self.experts = Experts(config)
        shared = config.moe_intermediate_size * config.n_shared_experts
        self.shared_experts = MLP(config.hidden_size, shared) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        weights, experts = self.gate(x)
        out = self.experts(x, weights, experts)
        return out if self.shared_experts is None else out + self.shared_experts(x)
