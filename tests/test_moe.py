"""DeepSeekMoE equals transformers' DeepseekV3MoE, feeds its experts exactly top-k rows
per token, and can be captured: every shape is fixed by the token count."""

from __future__ import annotations

import pytest
import torch

from updraft.graph.recorded import RecordedGraph
from updraft.kernels.build import kernel_builds
from updraft.model_config import MoEConfig
from updraft.models.moe import SparseMoE
from updraft.models.packing import pack_model
from updraft.weights import WeightFormat

pytestmark = pytest.mark.skipif(
    not kernel_builds("linear"), reason="needs a C compiler to build the expert kernel"
)

TINY = dict(
    hidden_size=32,
    moe_intermediate_size=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
)


def reference_and_ours(seed: int = 0, packed: bool = True):
    """transformers' layer and ours with the same random weights; ours packed for the
    CPU as a loaded model's is (``packed``), or as built."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    torch.manual_seed(seed)
    reference = DeepseekV3MoE(DeepseekV3Config(**TINY)).eval()
    state = reference.state_dict()
    for tensor in state.values():
        tensor.copy_(torch.randn_like(tensor) * 0.3)
    # A correction that changes which experts are chosen, not their weights.
    state["gate.e_score_correction_bias"].copy_(torch.randn(8) * 0.5)
    same_names = {name: value for name, value in TINY.items() if name != "n_routed_experts"}
    ours = SparseMoE(MoEConfig(num_experts=TINY["n_routed_experts"], **same_names)).eval()
    with torch.no_grad():
        ours.gate.weight.copy_(state["gate.weight"])
        ours.gate.e_score_correction_bias.copy_(state["gate.e_score_correction_bias"])
        ours.experts.gate_up_proj.copy_(state["experts.gate_up_proj"])
        ours.experts.down_proj.copy_(state["experts.down_proj"])
        ours.shared_experts.gate_up_proj.weight.copy_(
            torch.cat(
                [state["shared_experts.gate_proj.weight"], state["shared_experts.up_proj.weight"]]
            )
        )
        ours.shared_experts.down_proj.weight.copy_(state["shared_experts.down_proj.weight"])
    if packed:
        pack_model(ours, WeightFormat("float32"), torch.float32)
    return reference, ours


@torch.inference_mode()
def test_moe_equals_transformers():
    reference, ours = reference_and_ours()
    for tokens in (1, 3, 40):
        x = torch.randn(tokens, 32)
        torch.testing.assert_close(ours(x), reference(x[None])[0], atol=1e-5, rtol=1e-5)


@torch.inference_mode()
def test_experts_see_top_k_rows_per_token_and_idle_experts_are_not_read(monkeypatch):
    _, ours = reference_and_ours(seed=1)
    seen = []
    ops = torch.ops.updraft
    kernel = ops.grouped_mlp

    class Spy:
        def __getattr__(self, name):
            return getattr(ops, name)

        def grouped_mlp(self, rows, offsets, *weights):
            seen.append((rows.shape[0], offsets.clone()))
            return kernel(rows, offsets, *weights)

    monkeypatch.setattr(torch.ops, "updraft", Spy())
    ours(torch.randn(5, 32))
    ((rows, offsets),) = seen
    assert rows == 5 * 2  # tokens x top-k, not tokens x experts
    assert offsets[0] == 0 and offsets[-1] == rows and (offsets.diff() >= 0).all()
    # With one group of four experts allowed per token, some experts get no rows.
    assert (offsets.diff() == 0).any()


@torch.inference_mode()
def test_a_captured_moe_layer_replays_new_routing():
    _, ours = reference_and_ours(seed=2)
    x = torch.zeros(6, 32)
    graph = RecordedGraph(constants=[*ours.parameters(), *ours.buffers()], persistent=[x])
    out = graph.capture(lambda: ours(x))
    for seed in (3, 4):
        torch.manual_seed(seed)
        x.copy_(torch.randn(6, 32) * 2)
        graph.replay({})
        torch.testing.assert_close(out, ours(x), atol=1e-5, rtol=1e-5)


def test_the_unpacked_experts_equal_the_kernel():
    """Other devices and dtypes run the experts per row, with the same result."""
    _, packed = reference_and_ours(seed=2)
    _, unpacked = reference_and_ours(seed=2, packed=False)
    x = torch.randn(7, 32)
    with torch.inference_mode():
        torch.testing.assert_close(unpacked(x), packed(x), atol=1e-5, rtol=1e-5)
