"""OpenAI's gpt-oss: Llama's grouped-query attention with q/k/v/o biases and a learned
sink logit per query head (``attention/merge.py``: it joins each softmax's denominator),
sliding and full layers alternating, YaRN, and in every layer a mixture of experts.

The router is a linear layer with a bias: each token takes the top k of its logits, and
the softmax over those k weighs them. Each expert is a gated MLP with biases whose
activation is ``clamped_swiglu``. Its weights are kept as ``Experts``' are: gate_up_proj
[E, 2I, H] (the gate's rows, then the up's), down_proj [E, H, I], and their biases
[E, 2I] and [E, H]. transformers stores them transposed ([E, H, 2I], [E, I, H]) with
the gate's and the up's columns interleaved (even ones the gate's); ``from_checkpoint``
lays them out here as they load.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from updraft.model_config import ModelConfig, MoEConfig
from updraft.models.layers import CausalLM, DecoderLayer
from updraft.models.llama import Attention
from updraft.models.moe import RoutedExperts

# Rows of (token, expert) pairs gathered with their experts' weights at once: the float
# path copies each row's weights, so this bounds what a long prefill holds at a time.
ROWS_AT_ONCE = 64


def clamped_swiglu(
    gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float
) -> torch.Tensor:
    """gpt-oss's activation: the gate clamped above at ``limit``, the up clamped to
    [-limit, limit], then gate * sigmoid(alpha * gate) * (up + 1)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return gate * torch.sigmoid(alpha * gate) * (up + 1)


class GptOssRouter(nn.Module):
    """Logits = x W^T + b (in float32, whatever the compute dtype, so that rounding
    changes no choice); the top k experts, weighted by the softmax of their k logits."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        experts, hidden = config.num_experts, config.hidden_size
        self.weight = nn.Parameter(torch.zeros(experts, hidden, dtype=torch.float32))
        self.bias = nn.Parameter(torch.zeros(experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] float32, experts [T, k] int64)."""
        logits = F.linear(x.float(), self.weight.float(), self.bias.float())
        best = logits.topk(self.top_k, dim=-1)
        return best.values.softmax(dim=-1), best.indices


class GptOssExperts(RoutedExperts):
    """The routed experts in float: each (token, expert) row through its expert's
    weights, gathered per row (no shape depends on the routing, so a graph holds it; it
    copies each row's weights, so it is the correct path, not the fast one)."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.num_experts = experts = config.num_experts
        size, hidden = config.moe_intermediate_size, config.hidden_size
        self.alpha = config.swiglu_alpha
        self.limit = config.swiglu_limit
        self.gate_up_proj = nn.Parameter(torch.zeros(experts, 2 * size, hidden))
        self.gate_up_bias = nn.Parameter(torch.zeros(experts, 2 * size))
        self.down_proj = nn.Parameter(torch.zeros(experts, hidden, size))
        self.down_bias = nn.Parameter(torch.zeros(experts, hidden))

    @staticmethod
    def from_checkpoint(name: str, tensor: torch.Tensor) -> torch.Tensor:
        """transformers' tensor for the parameter ``name`` in the layout kept here."""
        if name in ("gate_up_proj", "gate_up_bias"):  # gate, up columns interleaved
            tensor = torch.cat([tensor[..., ::2], tensor[..., 1::2]], dim=-1)
        if name in ("gate_up_proj", "down_proj"):  # stored [E, in, out]
            tensor = tensor.transpose(1, 2)
        return tensor

    def _grouped(
        self, rows: torch.Tensor, chosen: torch.Tensor, order: torch.Tensor
    ) -> torch.Tensor:
        experts = chosen.index_select(0, order)
        return torch.cat(
            [
                self._through(
                    rows[first : first + ROWS_AT_ONCE], experts[first : first + ROWS_AT_ONCE]
                )
                for first in range(0, rows.shape[0], ROWS_AT_ONCE)
            ]
        )

    def _through(self, rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """rows [R, H], each through its expert of ``experts`` [R] -> [R, H]."""
        gate_up = torch.baddbmm(
            self.gate_up_bias.index_select(0, experts)[:, :, None],
            self.gate_up_proj.index_select(0, experts),
            rows[:, :, None],
        )[:, :, 0]
        gate, up = gate_up.chunk(2, dim=-1)
        hidden = clamped_swiglu(gate, up, self.alpha, self.limit)
        return torch.baddbmm(
            self.down_bias.index_select(0, experts)[:, :, None],
            self.down_proj.index_select(0, experts),
            hidden[:, :, None],
        )[:, :, 0]


class GptOssMoE(nn.Module):
    """Every layer's mixture: ``router`` chooses and weighs, ``experts`` (a
    ``RoutedExperts``: float here, or kept in MXFP4) compute."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.router = GptOssRouter(config)
        self.experts: RoutedExperts = GptOssExperts(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        weights, experts = self.router(x)
        return self.experts(x, weights, experts)


class GptOssAttention(Attention):
    """Llama's attention with an output bias and a sink logit per query head."""

    def __init__(self, config: ModelConfig, name: str, window: int | None) -> None:
        super().__init__(config, name, window)
        q_size = config.num_heads * config.head_dim
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=True)
        self.sinks = nn.Parameter(torch.zeros(config.num_heads))


def gpt_oss_layer(config: ModelConfig, index: int) -> DecoderLayer:
    name = f"model.layers.{index}.self_attn"
    attention = GptOssAttention(config, name, config.window(index))
    return DecoderLayer(config, attention, GptOssMoE(config.moe))


class GptOssForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__(config, gpt_oss_layer, config.rotary_dim, max_positions)
