"""DeepSeek-V3 (with and without q_lora), V3.2 (DSA) and V2 (softmax router, no q_lora)
against transformers, and the engine's features on them: the latent cache, absorbed
decode, MoE routing cost, prefix caching, preemption, speculation, sanitize, doctor and
the server."""

from __future__ import annotations

import httpx
import pytest
import torch
import transformers

from tests.checkpoints import build_checkpoint
from tests.conftest import add_byte_tokenizer
from tests.helpers import greedy, token_ids
from tests.probes import assert_idle, logits_of, probed, records
from tests.serving import running_server
from tests.test_reference_models import PROMPTS, assert_logits_match
from updraft import LLM
from updraft.attention import latent, loop
from updraft.cli import main
from updraft.config import EngineConfig
from updraft.engine.engine import Engine
from updraft.model_config import ModelConfig
from updraft.models.loader import load_model
from updraft.serve.serving import ServeSettings


@pytest.mark.parametrize("token_budget", [1024, 10], ids=["whole-prefill", "chunked-prefill"])
def test_logits_match_transformers_over_prefill_and_decode(tiny_deepseek, token_budget):
    assert_logits_match(tiny_deepseek[1], token_budget)


def test_attention_gathered_instead_of_read_in_place_matches_too(tiny_deepseek, monkeypatch):
    """Where the CPU kernel does not run (GPUs, other dtypes), decodes attend over the
    gathered context, and with DSA under the selection's mask."""
    monkeypatch.setattr(loop, "reads_cache_in_place", lambda query: False)
    assert_logits_match(tiny_deepseek[1], token_budget=10)


@pytest.mark.parametrize(
    "mscale, mscale_all_dim", [(1.0, 1.0), (1.0, 0.5)], ids=["as-released", "unequal"]
)
def test_yarn_with_deepseeks_softmax_correction_matches_transformers(
    tmp_path, mscale, mscale_all_dim
):
    """DeepSeek's released configs scale RoPE with YaRN and ``mscale_all_dim``, which
    also multiplies the softmax scale by mscale squared. Prompts and decodes run past
    the original context of 16 positions."""
    rope = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "original_max_position_embeddings": 16,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": mscale,
        "mscale_all_dim": mscale_all_dim,
    }
    build_checkpoint("deepseek-v3", tmp_path, sharpen=False, rope_parameters=rope)
    assert_logits_match(tmp_path)


def test_v2s_ungrouped_greedy_router_matches_transformers(tmp_path):
    build_checkpoint(
        "deepseek-v2",
        tmp_path,
        sharpen=False,
        n_group=None,
        topk_group=None,
        q_lora_rank=16,
        topk_method="greedy",
        routed_scaling_factor=2.0,
    )
    assert_logits_match(tmp_path)


def test_greedy_equals_transformers_generate(tiny_deepseek):
    kind, model_dir = tiny_deepseek
    outputs = LLM(model_dir, block_size=8, num_kv_blocks=64).generate(PROMPTS, greedy(30))
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        expected = reference.generate(
            torch.tensor([prompt]), max_new_tokens=30, do_sample=False, pad_token_id=0
        )[0, len(prompt) :].tolist()
        assert output.outputs[0].token_ids == expected, kind


@pytest.mark.parametrize("kind", ["deepseek-v3", "deepseek-v3.2"])
@torch.inference_mode()
def test_the_cache_holds_the_normed_latent_then_the_rotated_key(tmp_path, kind):
    """kv_lora_rank + qk_rope_head_dim values per token per layer (+ the indexer's key
    for V3.2), with the latent and key equal to what transformers computes for them."""
    model_dir = build_checkpoint(kind, tmp_path / "model")
    llm = probed(model_dir, block_size=4, num_kv_blocks=16, enforce_eager=True)
    prompt = list(range(30, 41))
    llm.generate([prompt], greedy(1))
    kv_caches = records(llm).kv_caches()
    config = ModelConfig.from_dir(model_dir)
    width = config.mla.kv_lora_rank + config.mla.qk_rope_head_dim
    if config.indexer is not None:
        width += config.indexer.head_dim
    assert [tuple(c.shape) for c in kv_caches] == [(16 * 4 + 1, width)] * 3
    per_token = kv_caches[0][:-1].numel() // (16 * 4)
    assert per_token == width  # what KV planning charges per token per layer

    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    attention = reference.model.layers[0].self_attn
    hidden = reference.model.layers[0].input_layernorm(
        reference.model.embed_tokens(torch.tensor([prompt]))
    )
    c_kv, k_rot = attention.kv_a_proj_with_mqa(hidden).split([24, 8], dim=-1)
    cos, sin = reference.model.rotary_emb(hidden, torch.arange(len(prompt))[None])
    _, k_rot = transformers.models.deepseek_v3.modeling_deepseek_v3.apply_rotary_pos_emb_interleave(
        k_rot[:, None], k_rot[:, None], cos, sin
    )
    # The prompt's first block is block 0 of a fresh pool: slots 0.. in order.
    rows = kv_caches[0][: len(prompt)]
    torch.testing.assert_close(rows[:, :24], attention.kv_a_layernorm(c_kv)[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(rows[:, 24:32], k_rot[0, 0], atol=1e-5, rtol=0)


def test_prefix_caching_reuses_latent_blocks(tiny_deepseek):
    _, model_dir = tiny_deepseek
    llm = probed(model_dir, block_size=4, num_kv_blocks=64)
    prompt = list(range(10, 33))
    first = llm.generate([prompt], greedy(6))[0]
    again = llm.generate([prompt], greedy(6))[0]
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    steps = records(llm).steps_of("target")
    computed = [s.num_tokens for s in steps if s.request_ids == [again.request_id]]
    assert computed[0] == len(prompt) - (len(prompt) - 1) // 4 * 4  # only the last block's tail


def test_decode_attends_in_latent_space_and_never_expands_the_cache(monkeypatch):
    """Only prefill steps call kv_b_proj on cached context; decodes use the absorbed form."""
    import tempfile

    expanded = []
    expand = latent.expand_latent

    def spy(rows, weight, dims):
        expanded.append(rows.shape[0])
        return expand(rows, weight, dims)

    monkeypatch.setattr(latent, "expand_latent", spy)
    with tempfile.TemporaryDirectory() as directory:
        model_dir = build_checkpoint("deepseek-v3", directory)
        for eager in (True, False):
            expanded.clear()
            llm = LLM(model_dir, block_size=4, num_kv_blocks=32, enforce_eager=eager)
            llm.generate([list(range(5, 20))], greedy(10))
            # one prefill step, three layers; the nine decode steps add nothing
            assert len(expanded) == 3, (eager, expanded)


def test_experts_see_tokens_times_top_k_rows_in_every_step(monkeypatch, tmp_path):
    model_dir = build_checkpoint("deepseek-v3", tmp_path / "model")
    llm = probed(model_dir, block_size=4, num_kv_blocks=64, enforce_eager=True)
    rows_per_call = []
    ops = torch.ops.updraft

    class Spy:
        def __getattr__(self, name):
            return getattr(ops, name)

        def grouped_mlp(self, rows, offsets, gate_up, *rest):
            rows_per_call.append((rows.shape[0], gate_up.shape[0]))
            return ops.grouped_mlp(rows, offsets, gate_up, *rest)

    monkeypatch.setattr(torch.ops, "updraft", Spy())
    llm.generate(PROMPTS, greedy(5))
    monkeypatch.undo()
    steps = [step.num_tokens for step in records(llm).steps_of("target")]
    # two MoE layers per step (layer 0 is dense), top-2 of 8 experts
    expected = [(tokens * 2, 8) for tokens in steps for _ in range(2)]
    assert rows_per_call == expected


def test_preemption_and_speculation_keep_greedy_outputs(tmp_path):
    target = build_checkpoint("deepseek-v3.2", tmp_path / "target")
    draft = build_checkpoint("deepseek-v3", tmp_path / "draft", seed=1)
    prompts = [list(range(10, 30)) + [i, i + 1] * (i % 3 + 1) for i in range(40, 48)]
    prompts += [[7, 8, 9, 7, 8, 9, 7, 8]]
    params = [greedy(n) for n in (20, 7, 13, 25, 9, 16, 11, 18, 30)]
    expected = token_ids(LLM(target, block_size=4, num_kv_blocks=512).generate(prompts, params))
    runs = {
        "preemption": dict(num_kv_blocks=30, max_num_batched_tokens=24),
        "ngram": dict(num_kv_blocks=512, speculative_method="ngram"),
        "draft": dict(num_kv_blocks=512, speculative_model=str(draft)),
        "draft, eager": dict(num_kv_blocks=512, speculative_model=str(draft), enforce_eager=True),
    }
    for name, args in runs.items():
        llm = LLM(target, block_size=4, **args)
        outputs = llm.generate(prompts, params)
        assert token_ids(outputs) == expected, name
        assert_idle(llm)
        if name == "preemption":
            assert sum(o.metrics.num_preemptions for o in outputs) > 0
        else:
            assert llm.engine.stats().speculative.rounds > 0, name


def test_sanitize_and_doctor_find_replay_equal_to_eager(tmp_path, capsys):
    model_dir = add_byte_tokenizer(build_checkpoint("deepseek-v3.2", tmp_path))
    llm = LLM(model_dir, block_size=4, num_kv_blocks=64, sanitize=True, capture_sizes=(1, 2, 4))
    llm.generate(PROMPTS, greedy(8))
    report = llm.engine.stats().sanitize
    assert report.steps > 0 and report.healthy
    assert main(["doctor", "--model", str(model_dir), "--capture-sizes", "1,2,4"]) == 0
    assert capsys.readouterr().out.strip().endswith("healthy")


def test_the_server_serves_a_deepseek_model(tmp_path):
    model_dir = add_byte_tokenizer(build_checkpoint("deepseek-v3", tmp_path))
    engine = Engine(EngineConfig(model=str(model_dir), block_size=4, num_kv_blocks=64))
    expected = LLM(model_dir, block_size=4, num_kv_blocks=64).generate("def f(x):", greedy(12))
    with running_server(ServeSettings(model_name="tiny-deepseek"), engine=engine) as url:
        body = {
            "model": "tiny-deepseek",
            "prompt": "def f(x):",
            "max_tokens": 12,
            "ignore_eos": True,
        }
        reply = httpx.post(f"{url}/v1/completions", json={**body, "temperature": 0}, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == expected[0].outputs[0].text


@pytest.mark.parametrize(
    "change, message",
    [
        ({"quantization_config": {"quant_method": "fp8"}}, r"quant_method 'fp8' is not supported"),
        ({"n_group": 3}, r"n_routed_experts 8 is not a multiple of n_group 3"),
        ({"num_experts_per_tok": 6}, r"num_experts_per_tok 6 experts cannot be chosen"),
        ({"kv_lora_rank": 0}, r"kv_lora_rank must be a positive int"),
        ({"qk_rope_head_dim": 7}, r"qk_rope_head_dim must be even"),
        ({"hidden_act": "gelu"}, r"hidden_act 'gelu' is not supported"),
        ({"architectures": ["DeepseekV4ForCausalLM"]}, r"unsupported architecture"),
    ],
)
def test_bad_deepseek_configs_are_named(tmp_path, change, message):
    import json

    model_dir = build_checkpoint("deepseek-v3", tmp_path)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=message):
        LLM(model_dir)


def test_a_missing_expert_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    model_dir = build_checkpoint("deepseek-v3", tmp_path)
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing .*experts\.gate_up_proj \(expert 5's up_proj\)"):
        LLM(model_dir)


def test_bfloat16_compute_stays_close_and_routes_in_float32(tiny_deepseek):
    _, model_dir = tiny_deepseek
    logits = []
    for dtype in ("float32", "bfloat16"):
        llm = probed(model_dir, dtype=dtype)
        (output,) = llm.generate([PROMPTS[2]], greedy(1))
        logits.append(logits_of(records(llm), output)[0])
    full, half = logits
    assert (full - half).abs().max().item() < 0.1 * full.abs().max().item()
    model = load_model(ModelConfig.from_dir(model_dir), model_dir, torch.bfloat16)
    router = model.model.layers[1].mlp.gate
    assert router.weight.dtype == torch.float32
    bias = router.e_score_correction_bias  # V3's; V2's router has none
    assert bias is None or bias.dtype == torch.float32
