"""Qwen3-MoE (softmax top-k router, normalised where the config says, dense layers where
mlp_only_layers and decoder_sparse_step say), Mixtral (softmax top-2, renormalised,
its experts as w1/w2/w3 in block_sparse_moe) and Qwen2-MoE (a shared expert of its own
width scaled by sigmoid(shared_expert_gate(x)), q/k/v biases) against transformers."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file

from tests.checkpoints import TINY, build_checkpoint
from tests.helpers import greedy, token_prompts
from tests.test_reference_models import PROMPTS, assert_logits_match
from updraft import LLM
from updraft.model_config import ModelConfig

MOE = ["mixtral", "qwen3-moe", "qwen3-moe-unnormalised", "qwen2-moe"]
# What speculation and int8 experts do to a mixture is the same for every family's
# router: three families show it.
SPECULATED = ["mixtral", "qwen3-moe", "qwen3-moe-unnormalised"]


@pytest.fixture(scope="module", params=MOE)
def moe_checkpoint(request, tmp_path_factory):
    kind = request.param
    return kind, build_checkpoint(kind, tmp_path_factory.mktemp(kind))


@pytest.mark.parametrize("token_budget", [1024, 10], ids=["whole-prefill", "chunked-prefill"])
def test_logits_match_transformers(moe_checkpoint, token_budget):
    assert_logits_match(moe_checkpoint[1], token_budget)


def test_greedy_equals_transformers_generate_graphs_on_and_off(moe_checkpoint):
    model_dir = moe_checkpoint[1]
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    expected = []
    for prompt in PROMPTS:
        with torch.no_grad():
            out = reference.generate(
                torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12
            )
        expected.append(out[0, len(prompt) :].tolist())
    for eager in (True, False):
        llm = LLM(model_dir, enforce_eager=eager, block_size=4, num_kv_blocks=128)
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(12))]
        assert got == expected, eager
        if not eager:
            assert "graph" in llm.engine.stats().steps


def test_dense_and_sparse_layers_follow_the_config():
    config = ModelConfig.from_dict(
        {
            "architectures": ["Qwen3MoeForCausalLM"],
            **{k: v for k, v in TINY.items() if v is not None},
            "num_hidden_layers": 6,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 8,
            "decoder_sparse_step": 2,
            "mlp_only_layers": [5],
        }
    )
    assert [config.has_experts(i) for i in range(6)] == [False, True, False, True, False, False]


def test_mixtral_hub_names_are_what_loads(moe_checkpoint):
    """save_pretrained writes the Hub's layout (per-expert w1/w2/w3 in block_sparse_moe,
    per-expert gate/up/down_proj in mlp for Qwen3-MoE): that is what the engine reads."""
    kind, model_dir = moe_checkpoint
    names = set(load_file(model_dir / "model.safetensors"))
    if kind == "mixtral":
        assert "model.layers.0.block_sparse_moe.experts.3.w3.weight" in names
    else:
        assert any(n.endswith("mlp.experts.0.gate_proj.weight") for n in names)


@pytest.mark.parametrize("moe_checkpoint", SPECULATED, indirect=True)
def test_int8_experts_and_speculation_keep_greedy_output(moe_checkpoint):
    model_dir = moe_checkpoint[1]
    prompts = token_prompts(6, seed=3)
    plain = LLM(model_dir, enforce_eager=True).generate(prompts, greedy(16))
    drafted = LLM(model_dir, speculative_method="ngram", num_speculative_tokens=3)
    assert [o.outputs[0].token_ids for o in drafted.generate(prompts, greedy(16))] == [
        o.outputs[0].token_ids for o in plain
    ]
    quantized = LLM(model_dir, quantization="int8", activations="float32", enforce_eager=True)
    agree = sum(
        a.outputs[0].token_ids[:4] == b.outputs[0].token_ids[:4]
        for a, b in zip(quantized.generate(prompts, greedy(16)), plain, strict=True)
    )
    assert agree >= 4  # int8's rounding may flip a near tie, not the whole batch


def test_a_mixtral_window_shorter_than_the_prompts_matches_transformers(tmp_path):
    build_checkpoint("mixtral", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["sliding_window"] = 8
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert_logits_match(tmp_path)


def test_two_ranks_split_the_experts_and_compute_what_one_process_computes(moe_checkpoint, pool):
    from tests.test_tensor_parallel import assert_two_ranks_compute_like_one_process

    assert_two_ranks_compute_like_one_process(moe_checkpoint[1], pool)


@pytest.mark.parametrize("moe_checkpoint", SPECULATED, indirect=True)
def test_a_draft_model_keeps_greedy_output(moe_checkpoint):
    """The model drafting for itself: every draft accepted, the output unchanged."""
    model_dir = moe_checkpoint[1]
    prompts = token_prompts(4, seed=5)
    plain = LLM(model_dir, enforce_eager=True).generate(prompts, greedy(12))
    drafted = LLM(model_dir, speculative_model=str(model_dir), num_speculative_tokens=3)
    outputs = drafted.generate(prompts, greedy(12))
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in plain]
    metrics = drafted.engine.stats().speculative
    assert metrics.num_draft_tokens > 0 and metrics.num_accepted_tokens == metrics.num_draft_tokens
