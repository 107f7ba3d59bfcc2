"""The engine against Hugging Face transformers, the reference no one here wrote.

Tiny random Llama (GQA, Llama 3 RoPE scaling), Qwen2 (MQA, bias, tied) and Qwen3 (q/k
norm) checkpoints in float32: a mixed batch of prompts of different lengths, prefilled
together and decoded 24 steps, gives the logits of transformers' forward over the same
tokens, and greedy output equals transformers' greedy ``generate``.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from tests.checkpoints import build_checkpoint, sharded_copy
from tests.helpers import greedy
from tests.probes import logits_of, probed, records
from updraft import LLM

PROMPTS = [list(range(3, 10)), [200, 17], list(range(40, 77)), [5] * 20 + [6, 7, 8]]
DECODE_STEPS = 24


def reference_logits(model_dir, token_ids: list[int]) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return model.eval()(torch.tensor([token_ids])).logits[0]


def assert_logits_match(model_dir, token_budget: int = 1024) -> None:
    """Prefill PROMPTS together (in chunks when ``token_budget`` is small), decode
    DECODE_STEPS, and compare every emitted token's logits with transformers' forward."""
    llm = probed(
        model_dir,
        block_size=4,
        num_kv_blocks=128,
        max_num_batched_tokens=token_budget,
        activations="float32",  # the exact path (a bfloat16 checkpoint's batches unrounded)
    )
    outputs = llm.generate(PROMPTS, greedy(DECODE_STEPS + 1))
    seen = records(llm)
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        completion = output.outputs[0]
        assert len(completion.token_ids) == DECODE_STEPS + 1
        sequence = prompt + completion.token_ids
        with torch.no_grad():
            expected = reference.eval()(torch.tensor([sequence])).logits[0]
        # Row i is the distribution of output token i: position len(prompt) - 1 + i.
        expected = expected[len(prompt) - 1 : len(sequence) - 1]
        got = logits_of(seen, output)
        assert got.shape == expected.shape
        assert (got - expected).abs().max().item() < 1e-4, model_dir


@pytest.mark.parametrize(
    "token_budget",
    [1024, 10],
    ids=["whole-prefill", "chunked-prefill-beside-decodes"],
)
def test_logits_match_transformers_over_prefill_and_decode(tiny_checkpoint, token_budget):
    assert_logits_match(tiny_checkpoint[1], token_budget)


@pytest.mark.parametrize(
    "rope",
    [
        {"factor": 4.0},
        # DeepSeek's form: the cos/sin scale is a ratio of two mscale terms.
        {"factor": 8.0, "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2},
    ],
    ids=["yarn", "yarn-mscale"],
)
def test_yarn_rope_matches_transformers(tmp_path, rope):
    """Prompts and decodes run past the original context of 32 positions."""
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "original_max_position_embeddings": 32}
    build_checkpoint("qwen2-plain", tmp_path, rope_parameters={**yarn, **rope})
    assert_logits_match(tmp_path)


def test_greedy_equals_transformers_generate(tiny_checkpoint):
    kind, model_dir = tiny_checkpoint
    # The prompts' one prefill step (69 tokens) replays a mixed bucket; decodes theirs.
    llm = LLM(model_dir, block_size=8, num_kv_blocks=64, capture_tokens=(128,))
    outputs = llm.generate(PROMPTS, greedy(30))
    assert set(llm.engine.stats().steps) == {"graph"}
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        expected = reference.generate(
            torch.tensor([prompt]),
            max_new_tokens=30,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        assert output.outputs[0].token_ids == expected, kind


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_checkpoints_load_and_compute_in_float32(tmp_path, dtype):
    model_dir = build_checkpoint("qwen3", tmp_path, dtype=dtype)
    llm = probed(model_dir, dtype="float32", num_kv_blocks=32)
    output = llm.generate(PROMPTS[0], greedy(4, ignore_eos=False))[0]
    sequence = PROMPTS[0] + output.outputs[0].token_ids
    expected = reference_logits(model_dir, sequence)[len(PROMPTS[0]) - 1 : -1]
    assert (logits_of(records(llm), output) - expected).abs().max().item() < 1e-4


def test_bfloat16_compute_stays_close_to_float32(tiny_llama):
    prompt = PROMPTS[2]
    params = greedy(1, ignore_eos=False)
    full_llm, half_llm = probed(tiny_llama), probed(tiny_llama, dtype="bfloat16")
    full = full_llm.generate(prompt, params)[0]
    half = half_llm.generate(prompt, params)[0]
    full_logits = logits_of(records(full_llm), full)[0]
    half_logits = logits_of(records(half_llm), half)[0]
    assert half_logits.dtype == torch.float32
    assert (full_logits - half_logits).abs().max().item() < 0.1 * full_logits.abs().max().item()


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path):
    single = build_checkpoint("llama", tmp_path / "single")
    sharded_copy(single, tmp_path / "sharded")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    params = greedy(8)
    a = LLM(single).generate(PROMPTS, params)
    b = LLM(tmp_path / "sharded").generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
