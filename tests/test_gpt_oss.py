"""gpt-oss against transformers: a tiny random GptOssForCausalLM (tests/checkpoints.py
"gpt-oss": sinks, a sliding layer whose window is shorter than the prompts then a full
one, YaRN past its original context, float experts with biases and a clamp that bites).

Logits within 1e-4 of transformers' forward (whole and chunked prefill), greedy tokens
equal to its ``generate`` eager and with FULL and PIECEWISE graphs, the same tokens and
logits split over ranks (TP=2, TP=2 with DCP=2, PCP=2), n-gram speculation that changes
no token (graphs on and off), a bfloat16 checkpoint, the config as transformers reads
it, and the mistakes each piece guards against failing the parity test."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from tests.checkpoints import GPT_OSS, build_checkpoint
from tests.helpers import greedy, token_ids
from tests.probes import logits_of, probed, records
from tests.test_reference_models import PROMPTS, assert_logits_match
from tests.test_sliding_window import GRAPH_MODES, _run, assert_greedy_equals_generate
from tests.test_weight_formats import cpu_flags
from updraft import LLM
from updraft.kernels import ops
from updraft.model_config import ModelConfig, MoEConfig
from updraft.model_config.parts import RopeConfig
from updraft.models import gpt_oss
from updraft.models.moe import PackedExperts
from updraft.models.rope import attention_factor, inverse_frequencies
from updraft.weights import WeightFormat


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint("gpt-oss", tmp_path_factory.mktemp("gpt-oss"))


# -- the config ------------------------------------------------------------------------

# gpt-oss-20b's config.json as published (the fields that are read).
PUBLISHED_20B = {
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "head_dim": 64,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072,
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 8,
    "num_local_experts": 32,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 201088,
}


def test_the_published_config_is_read_as_transformers_reads_it():
    ours = ModelConfig.from_dict(PUBLISHED_20B)
    theirs = transformers.GptOssConfig(**PUBLISHED_20B)
    expected = tuple(
        theirs.sliding_window if kind == "sliding_attention" else None
        for kind in theirs.layer_types
    )
    assert ours.layer_windows == expected and expected[:2] == (128, None)
    assert ours.attention_sinks and ours.attention_bias
    moe = ours.moe
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (
        theirs.num_local_experts,
        theirs.num_experts_per_tok,
        theirs.intermediate_size,
    )
    assert (moe.swiglu_alpha, moe.swiglu_limit) == (theirs.swiglu_alpha, theirs.swiglu_limit)
    assert (ours.rope.kind, ours.rope.theta, ours.rope.truncate) == ("yarn", 150000.0, False)


@pytest.mark.parametrize("head_dim", [64, 16])
def test_yarn_equals_transformers_for_gpt_oss_s_parameters(head_dim):
    """Not truncated: the ramp's ends stay fractional (floored and ceiled, they differ)."""
    raw = {**PUBLISHED_20B, "head_dim": head_dim}
    rope = ModelConfig.from_dict(raw).rope
    config = transformers.GptOssConfig(**raw)
    init = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["yarn"]
    inv_freq, scale = init(config, "cpu")
    torch.testing.assert_close(inverse_frequencies(rope, head_dim), inv_freq, rtol=1e-6, atol=0)
    assert math.isclose(attention_factor(rope), scale)
    truncated = RopeConfig(**{**rope.__dict__, "truncate": True})
    assert not torch.allclose(inverse_frequencies(truncated, head_dim), inv_freq, rtol=1e-4)


@pytest.mark.parametrize(
    "change, named",
    [
        ({"swiglu_limit": -1.0}, "swiglu_limit"),
        ({"num_experts_per_tok": 40}, "num_experts_per_tok"),
        ({"layer_types": ["full_attention"]}, "layer_types"),
        ({"num_local_experts": 0}, "num_local_experts"),
    ],
)
def test_a_config_it_cannot_serve_is_refused_by_name(change, named):
    with pytest.raises(ValueError, match=named):
        ModelConfig.from_dict({**PUBLISHED_20B, **change})


def test_clamped_swiglu_is_transformers_activation():
    """transformers' experts' own activation over interleaved columns, against the
    module function over the halves the loader lays them out in."""
    generator = torch.Generator().manual_seed(0)
    gate_up = torch.randn(5, 2 * 12, generator=generator) * 6
    config = transformers.GptOssConfig(swiglu_limit=GPT_OSS["swiglu_limit"], intermediate_size=12)
    experts = transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts(config)
    theirs = experts._apply_gate(gate_up)  # noqa: SLF001 (their activation, alone)
    laid_out = gpt_oss.GptOssExperts.from_checkpoint("gate_up_bias", gate_up)
    gate, up = laid_out.chunk(2, dim=-1)
    ours = gpt_oss.clamped_swiglu(gate, up, config.swiglu_alpha, config.swiglu_limit)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert (gate_up[:, ::2].abs() > config.swiglu_limit).any()  # the clamp bit


def test_experts_stored_in_another_layout_are_refused_by_name(checkpoint, tmp_path):
    tensors = load_file(checkpoint / "model.safetensors")
    name = "model.layers.1.mlp.experts.gate_up_proj"
    tensors[name] = tensors[name][0]  # one expert's, not the stack
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(checkpoint / "config.json", tmp_path / "config.json")
    with pytest.raises(ValueError, match="gate_up_proj must be 3-D"):
        LLM(tmp_path, block_size=4)


# -- the experts through the grouped expert kernel ------------------------------------------

EXPERTS = MoEConfig(
    hidden_size=64,
    moe_intermediate_size=40,
    num_experts=4,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    n_shared_experts=0,
    routed_scaling_factor=1.0,
    norm_topk_prob=True,
    swiglu_alpha=1.702,
    swiglu_limit=2.0,
)


@pytest.fixture(scope="module")
def float_experts():
    torch.manual_seed(0)
    experts = gpt_oss.GptOssExperts(EXPERTS).requires_grad_(False)
    for param in experts.parameters():
        param.copy_(torch.randn_like(param) * 0.3)
    return experts


@torch.inference_mode()
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_the_grouped_expert_kernel_computes_what_the_float_path_does(float_experts, tokens):
    """Biases and the clamped SwiGLU in ``updraft::grouped_mlp``, every expert (one with
    no rows) and a prefill's rows."""
    packed = PackedExperts.packed(float_experts, WeightFormat("float32"))
    x = torch.randn(tokens, EXPERTS.hidden_size)
    weights = torch.rand(tokens, 2)
    chosen = torch.stack([torch.randperm(3)[:2] for _ in range(tokens)])  # expert 3 idle
    expected = float_experts(x, weights, chosen)
    torch.testing.assert_close(packed(x, weights, chosen), expected, atol=1e-5, rtol=1e-5)


@torch.inference_mode()
@pytest.mark.parametrize("march", ["haswell", "x86-64"])
def test_the_expert_kernel_built_for_narrower_instructions_computes_the_same(float_experts, march):
    if march == "haswell" and not {"avx2", "fma", "f16c", "bmi2"} <= cpu_flags():
        pytest.skip("this CPU cannot run AVX2 code")
    packed = PackedExperts.packed(float_experts, WeightFormat("float32"))
    x = torch.randn(12, EXPERTS.hidden_size) * 3
    offsets = torch.tensor([0, 5, 5, 9, 12])
    args = (
        x,
        offsets,
        packed.gate_up_codes,
        None,
        None,
        packed.down_codes,
        None,
        None,
        packed.code,
        *packed.groups,
        packed.inter,
        packed.activation,
        packed.gate_up_bias,
        packed.down_bias,
        *packed.swiglu,
    )
    native = ops.grouped_mlp(*args)
    torch.testing.assert_close(ops.grouped_mlp(*args, march=march), native)


# -- against transformers ------------------------------------------------------------------


@pytest.mark.parametrize("token_budget", [1024, 10], ids=["whole-prefill", "chunked-prefill"])
def test_logits_match_transformers(checkpoint, token_budget):
    assert_logits_match(checkpoint, token_budget)


def test_greedy_equals_generate_eager_and_with_full_and_piecewise_graphs(checkpoint):
    assert_greedy_equals_generate(checkpoint, [{"enforce_eager": True}, *GRAPH_MODES])


def test_a_bfloat16_checkpoint_loads(tmp_path):
    """Kept in bfloat16 and computed in float32 it is transformers' float32 forward of
    the same weights; computed in bfloat16 (the experts' float path) it is near
    transformers' bfloat16 forward."""
    directory = build_checkpoint("gpt-oss", tmp_path, dtype=torch.bfloat16)
    assert ModelConfig.from_dir(directory).checkpoint_dtype == "bfloat16"
    assert_logits_match(directory)
    prompt = PROMPTS[2]
    llm = probed(directory, dtype="bfloat16", block_size=4, enforce_eager=True)
    (output,) = llm.generate([prompt], greedy(6))
    got = logits_of(records(llm), output)
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
    sequence = prompt + output.outputs[0].token_ids
    with torch.no_grad():
        expected = reference(torch.tensor([sequence])).logits[0].float()
    expected = expected[len(prompt) - 1 : len(sequence) - 1]
    assert (got - expected).abs().max() < 0.05 * expected.abs().max()  # bfloat16's rounding


# -- split over ranks ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def in_one_process(checkpoint):
    tokens, logits, _ = _run(checkpoint)
    return tokens, logits


@pytest.mark.parametrize(
    "layout",
    [
        dict(tensor_parallel_size=2),
        dict(tensor_parallel_size=2, decode_context_parallel_size=2),
        dict(prefill_context_parallel_size=2),
    ],
    ids=["tp2", "tp2-dcp2", "pcp2"],
)
def test_ranks_compute_what_one_process_computes(checkpoint, in_one_process, layout, pool):
    """Under TP each rank applies its own heads' sinks; under DCP they join the merge
    of the shards, once."""
    tokens, logits = in_one_process
    split_tokens, split_logits, _ = _run(checkpoint, worker_pool=pool, **layout)
    assert split_tokens == tokens
    for mine, theirs in zip(split_logits, logits, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=0)


# -- speculation ---------------------------------------------------------------------------


def test_ngram_speculation_changes_no_token_graphs_on_and_off(checkpoint):
    """Verify rows read the cache in place, sinks and all, as decodes do."""
    prompts = [list(range(3, 40)), [7, 8, 9] * 10, [5] * 20 + [6, 7, 8]]
    params = [greedy(30) for _ in prompts]
    args = dict(block_size=4, num_kv_blocks=128)
    plain = token_ids(LLM(checkpoint, enforce_eager=True, **args).generate(prompts, params))
    for eager in (True, False):
        llm = LLM(checkpoint, enforce_eager=eager, speculative_method="ngram", **args)
        assert token_ids(llm.generate(prompts, params)) == plain, eager
        stats = llm.engine.stats()
        assert stats.speculative.num_draft_tokens > 0
        assert any(step.startswith("graph") for step in stats.steps) != eager, stats.steps


# -- mutations: each piece left out fails the parity test ------------------------------------


def test_sinks_left_out_fail_the_parity_test(checkpoint, monkeypatch):
    from updraft.attention import loop

    monkeypatch.setattr(loop, "with_sinks", lambda out, lse, sinks: out)
    with pytest.raises(AssertionError):
        assert_logits_match(checkpoint)


def test_interleaved_gate_and_up_columns_left_as_they_are_fail_the_parity_test(
    checkpoint, monkeypatch
):
    def transposed_only(name, tensor):
        return tensor.transpose(1, 2) if name in ("gate_up_proj", "down_proj") else tensor

    monkeypatch.setattr(gpt_oss.GptOssExperts, "from_checkpoint", staticmethod(transposed_only))
    with pytest.raises(AssertionError):
        assert_logits_match(checkpoint)
