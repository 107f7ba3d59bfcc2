"""A mixture of experts: a router with group-limited top-k, routed experts and shared
ones (DeepSeekMoE; Qwen3-MoE and Mixtral are its one-group, unshared case).

V3's router scores every expert with a sigmoid. For choosing experts only, each score
gets the checkpoint's ``e_score_correction_bias``; the experts fall into ``n_group``
groups, a group is worth the sum of its two best corrected scores, and the top-k
experts are chosen among the ``topk_group`` best groups. The chosen experts' weights are
their uncorrected scores, normalised to sum to 1 (``norm_topk_prob``), times
``routed_scaling_factor``. V2's router is the same with a softmax, no bias, groups
worth their best score, and no normalising. Qwen3-MoE's and Mixtral's is the softmax
over a single group, normalised where the config says (Mixtral always). The shared
experts see every token; Qwen2-MoE's one shared expert is scaled per token by
sigmoid(shared_expert_gate(x)), a gate the router's width with one output.

Routed experts cost the tokens routed to them, not every expert for every token: the
(token, expert) pairs are sorted by expert and, on the CPU, ``updraft::grouped_mlp``
streams each chosen expert's weights once over its rows, in whatever format they are
kept (``PackedExperts``). Every shape is fixed by the token count
(top-k rows per token), so a captured graph can hold the whole layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from updraft.kernels.ops import EXPERT_ACTIVATIONS
from updraft.kernels.panels import Panels, pack_stacked
from updraft.model_config import MoEConfig
from updraft.models.layers import ACTIVATIONS, MLP
from updraft.models.packed_linear import kernel_code
from updraft.weights import WeightFormat


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


class RoutedExperts(nn.Module):
    """The routed experts' part of the layer: each (token, expert) pair's row through its
    expert, weighted and summed per token. How the rows meet their experts' weights is
    the subclass's ``_grouped``."""

    num_experts: int

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor:
        k = experts.shape[1]
        chosen = experts.flatten()
        order = torch.argsort(chosen, stable=True)  # (token, expert) pairs by expert
        token_of_row = order // k
        rows = self._grouped(x.index_select(0, token_of_row), chosen, order)
        rows = rows * weights.flatten().index_select(0, order)[:, None].to(rows.dtype)
        # Back in (token, expert) order and summed over each token's k rows: the same
        # sum in the same order at every run. An index_add compiles to atomic adds whose
        # order, and so whose rounding, changes from run to run.
        pairs = rows.index_select(0, torch.argsort(order))
        return pairs.view(-1, k, x.shape[1]).sum(dim=1)

    def _grouped(
        self, rows: torch.Tensor, chosen: torch.Tensor, order: torch.Tensor
    ) -> torch.Tensor:
        """``rows`` sorted by expert (row i goes to expert ``chosen[order[i]]``) through
        their experts' MLPs."""
        raise NotImplementedError


class Experts(RoutedExperts):
    """Every routed expert's weights, stacked: gate_up_proj [E, 2I, H] (gate rows, then
    up rows) and down_proj [E, H, I], in the compute dtype. On the CPU a loaded model's
    are packed (``PackedExperts``); this runs on other devices."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        self.activation = config.activation
        size, hidden = config.moe_intermediate_size, config.hidden_size
        self.gate_up_proj = nn.Parameter(torch.zeros(config.num_experts, 2 * size, hidden))
        self.down_proj = nn.Parameter(torch.zeros(config.num_experts, hidden, size))

    def _grouped(
        self, rows: torch.Tensor, chosen: torch.Tensor, order: torch.Tensor
    ) -> torch.Tensor:
        """Each row through its expert's weights, gathered per row. Correct and
        capturable (no shape depends on the routing), but it copies each row's weights:
        a fallback, not a fast path."""
        experts = chosen.index_select(0, order)
        gate, up = torch.bmm(self.gate_up_proj.index_select(0, experts), rows[:, :, None]).chunk(
            2, dim=1
        )
        hidden = ACTIVATIONS[self.activation](gate) * up
        return torch.bmm(self.down_proj.index_select(0, experts), hidden)[:, :, 0]


class PackedExperts(RoutedExperts):
    """``Experts`` on the CPU: every expert's weights in the panels of a weight format,
    through ``updraft::grouped_mlp``, which streams each chosen expert's weights once over
    its rows (the work follows the tokens routed, not the number of experts). gpt-oss's
    experts also keep their biases and their clamped SwiGLU's (alpha, limit)."""

    def __init__(
        self,
        gate_up: Panels,
        down: Panels,
        fmt: WeightFormat,
        activation: str = "silu",
        biases: tuple[torch.Tensor, torch.Tensor] | None = None,
        swiglu: tuple[float, float] | None = None,
    ) -> None:
        """Over stacked panels already made: gate_up [E, 2I, H] and down [E, H, I];
        ``biases`` [E, 2I] and [E, H] and the clamped SwiGLU's (alpha, limit) where the
        experts have them (gpt-oss's)."""
        super().__init__()
        self.num_experts = gate_up.codes.shape[0]
        self.activation = EXPERT_ACTIVATIONS.index(activation)
        self.format = fmt
        self.inter = down.in_features
        self.code, self.groups = kernel_code(gate_up, fmt), (gate_up.group, down.group)
        self.swiglu = swiglu or (0.0, 0.0)  # (alpha, limit): the clamped SwiGLU's only
        for prefix, panels in (("gate_up", gate_up), ("down", down)):
            for name in ("codes", "scales", "zeros"):
                self.register_buffer(f"{prefix}_{name}", getattr(panels, name), persistent=False)
        gate_up_bias, down_bias = biases or (None, None)
        self.register_buffer("gate_up_bias", gate_up_bias, persistent=False)
        self.register_buffer("down_bias", down_bias, persistent=False)

    @classmethod
    def packed(cls, experts: RoutedExperts, fmt: WeightFormat) -> PackedExperts:
        """``experts``' float weights (``Experts``', or gpt-oss's with biases and a
        clamped SwiGLU) packed into ``fmt``'s panels."""
        gate_up = pack_stacked(experts.gate_up_proj.detach(), fmt)
        down = pack_stacked(experts.down_proj.detach(), fmt)
        if getattr(experts, "gate_up_bias", None) is None:
            return cls(gate_up, down, fmt, experts.activation)
        biases = (experts.gate_up_bias.detach().float(), experts.down_bias.detach().float())
        return cls(gate_up, down, fmt, experts.activation, biases, experts.swiglu)

    def _grouped(
        self, rows: torch.Tensor, chosen: torch.Tensor, order: torch.Tensor
    ) -> torch.Tensor:
        return torch.ops.updraft.grouped_mlp(
            rows,
            expert_offsets(chosen, self.num_experts),
            self.gate_up_codes,
            self.gate_up_scales,
            self.gate_up_zeros,
            self.down_codes,
            self.down_scales,
            self.down_zeros,
            self.code,
            *self.groups,
            self.inter,
            self.activation,
            self.gate_up_bias,
            self.down_bias,
            *self.swiglu,
        )

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, {self.format}"


def expert_offsets(chosen: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Where each expert's rows start among the rows sorted by expert, and the end
    [E + 1] (int64), from each (token, expert) pair's expert."""
    counts = torch.zeros(num_experts, dtype=torch.int64).scatter_add(
        0, chosen, torch.ones_like(chosen)
    )
    return F.pad(counts.cumsum(0), (1, 0))


class SharedExpertGate(nn.Module):
    """Qwen2-MoE's per-token scale of its shared expert: sigmoid(x w), w [1, H]."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(F.linear(x, self.weight.to(x.dtype)))


class SparseMoE(nn.Module):
    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.gate = TopKRouter(config)
        self.experts = Experts(config)
        shared = config.shared_size
        self.shared_experts = MLP(config.hidden_size, shared) if shared else None
        self.shared_expert_gate = (
            SharedExpertGate(config.hidden_size) if config.shared_expert_gate else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        weights, experts = self.gate(x)
        out = self.experts(x, weights, experts)
        if self.shared_experts is None:
            return out
        shared = self.shared_experts(x)
        if self.shared_expert_gate is not None:
            shared = shared * self.shared_expert_gate(x)
        return out + shared
