"""Phi-3 and Phi-4-mini against transformers: fused qkv and gate/up projections in the
checkpoint, LongRoPE's short and long frequencies on both sides of the original
context (as transformers' generate switches them), partial rotary, tensor parallelism,
and a prefix cache that keeps long-prompt KV apart."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from tests.checkpoints import build_checkpoint, eagle_head_checkpoint
from tests.helpers import generate_logits, greedy, token_ids
from tests.probes import logits_of, probed, records
from updraft import LLM

# The checkpoints' original context is 32 positions (tests/checkpoints.py).
# Prompts inside the original context that decode past it, and prompts already past it.
PROMPTS = [list(range(3, 20)), [200, 17, 9], list(range(40, 80)), [5] * 30 + [6, 7, 8, 9]]
NEW_TOKENS = 24


@pytest.fixture(scope="module", params=["phi3", "phi4-mini"])
def phi3(request, tmp_path_factory):
    return build_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


def load(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


@pytest.mark.parametrize("token_budget", [1024, 10], ids=["whole-prefill", "chunked-prefill"])
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_logits_match_transformers_generate_on_both_sides_of_the_switch(phi3, token_budget, eager):
    llm = probed(
        phi3,
        block_size=4,
        num_kv_blocks=128,
        max_num_batched_tokens=token_budget,
        enforce_eager=eager,
    )
    outputs = llm.generate(PROMPTS, greedy(NEW_TOKENS))
    seen = records(llm)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        tokens, expected = generate_logits(load(phi3), prompt, NEW_TOKENS)
        assert list(output.outputs[0].token_ids) == tokens
        got = logits_of(seen, output)
        assert (got - expected).abs().max().item() < 1e-4
    assert ("graph" in llm.engine.stats().steps) != eager


def test_a_short_prompt_does_not_reuse_a_long_prompt_s_cached_blocks(phi3):
    """The same first 16 tokens: as part of a prompt past the original context their KV
    used the long frequencies, as a short prompt the short ones."""
    long_prompt, short_prompt = list(range(100, 140)), list(range(100, 116))
    alone = probed(phi3, block_size=4, num_kv_blocks=128)
    (expected,) = alone.generate([short_prompt], greedy(8))
    expected_logits = logits_of(records(alone), expected)
    shared = probed(phi3, block_size=4, num_kv_blocks=128)
    shared.generate([long_prompt], greedy(2))
    (output,) = shared.generate([short_prompt], greedy(8))
    assert output.outputs[0].token_ids == expected.outputs[0].token_ids
    torch.testing.assert_close(logits_of(records(shared), output), expected_logits)


def test_two_ranks_split_the_fused_projections_like_one_process(phi3, pool):
    from tests.test_tensor_parallel import assert_two_ranks_compute_like_one_process

    assert_two_ranks_compute_like_one_process(phi3, pool)


def test_a_window_shorter_than_the_context_beside_longrope_matches_transformers(tmp_path):
    """Phi-3-mini-4k's shape: a window (2047 of its 4096 positions) and LongRoPE."""
    build_checkpoint("phi3", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["sliding_window"] = 9
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = probed(tmp_path, block_size=4, num_kv_blocks=128, max_num_batched_tokens=10)
    outputs = llm.generate(PROMPTS, greedy(NEW_TOKENS))
    seen = records(llm)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        tokens, expected = generate_logits(load(tmp_path), prompt, NEW_TOKENS)
        assert list(output.outputs[0].token_ids) == tokens
        assert (logits_of(seen, output) - expected).abs().max().item() < 1e-4


def test_a_fused_tensor_of_the_wrong_size_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    build_checkpoint("phi3", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    name = "model.layers.0.self_attn.qkv_proj.weight"
    tensors[name] = tensors[name][:-4]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="qkv_proj"):
        LLM(tmp_path, enforce_eager=True)


def test_speculation_keeps_greedy_output_across_the_switch(phi3):
    """n-gram drafts on repetitive prompts that decode past the original context: no
    verify step reaches past it from below, and the switch recomputes the KV."""
    prompts = [[7, 8, 9] * 8, [11, 12] * 14, list(range(50, 60)) * 2]
    plain = LLM(phi3, enforce_eager=True).generate(prompts, greedy(NEW_TOKENS))
    drafted = LLM(phi3, speculative_method="ngram", num_speculative_tokens=4)
    outputs = drafted.generate(prompts, greedy(NEW_TOKENS))
    assert token_ids(outputs) == token_ids(plain)
    assert drafted.engine.stats().speculative.num_draft_tokens > 0


def test_an_eagle_head_keeps_greedy_output_across_the_switch(phi3, tmp_path):
    """A head reads the target's hidden states; its mirror steps follow the target's,
    the recompute at the switch included."""
    head = eagle_head_checkpoint(tmp_path / "head", phi3)
    plain = LLM(phi3, enforce_eager=True).generate(PROMPTS, greedy(NEW_TOKENS))
    drafted = LLM(
        phi3, speculative_method="eagle", speculative_model=str(head), num_speculative_tokens=3
    )
    assert token_ids(drafted.generate(PROMPTS, greedy(NEW_TOKENS))) == token_ids(plain)
    assert drafted.engine.stats().speculative.num_draft_tokens > 0


def test_the_server_serves_a_phi3_checkpoint(tmp_path):
    import shutil

    import httpx

    from tests.conftest import add_byte_tokenizer
    from tests.serving import running_server
    from updraft.config import EngineConfig
    from updraft.engine.engine import Engine
    from updraft.serve.serving import ServeSettings

    model = add_byte_tokenizer(build_checkpoint("phi3", tmp_path / "phi3"))
    shutil.copy(model / "tokenizer.json", tmp_path)  # the byte tokenizer speaks text
    engine = Engine(EngineConfig(model=str(model), enforce_eager=True))
    expected = LLM(model, enforce_eager=True).generate("x" * 40, greedy(12))[0].outputs[0]
    with running_server(ServeSettings(model_name="phi"), engine) as url:
        body = {"model": "phi", "prompt": "x" * 40, "max_tokens": 12, "temperature": 0}
        body["ignore_eos"] = True
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
    assert response["choices"][0]["text"] == expected.text
