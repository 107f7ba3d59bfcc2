"""Every bad input gets an error that names the problem; nothing else breaks and no KV
block leaks."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from safetensors.torch import load_file, save_file

from tests.checkpoints import build_checkpoint, sharded_copy
from tests.helpers import greedy
from tests.probes import assert_idle
from updraft import LLM, SamplingParams
from updraft.demo import DEMO_MODEL_DIR
from updraft.engine.input_processor import InputProcessor, ModelLimits
from updraft.structured_outputs import StructuredOutputsParams
from updraft.tokenizer import Tokenizer

GREEDY = greedy(8)


@pytest.fixture
def checkpoint(tmp_path, tiny_llama):
    target = tmp_path / "model"
    shutil.copytree(tiny_llama, target)
    return target


def assert_no_block_in_use(llm: LLM) -> None:
    assert_idle(llm)


def test_unknown_architecture_names_the_supported_ones(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*LlamaForCausalLM, Qwen2ForCausalLM"):
        LLM(checkpoint)


def test_unsupported_rope_type_names_the_supported_ones(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "dynamic", "rope_theta": 10000.0}
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"'dynamic'.*default, linear, llama3, yarn, longrope"):
        LLM(checkpoint)


def test_missing_model_directory_and_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="model directory not found"):
        LLM(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        LLM(tmp_path)


def test_missing_weights_file_is_named(checkpoint):
    (checkpoint / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no weights in .*model"):
        LLM(checkpoint)


def test_corrupt_weights_file_is_named(checkpoint):
    path = checkpoint / "model.safetensors"
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header" + path.read_bytes()[64:])
    with pytest.raises(ValueError, match=r"cannot read weights file .*model\.safetensors"):
        LLM(checkpoint)


def test_truncated_weights_file_is_named(checkpoint):
    path = checkpoint / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors"):
        LLM(checkpoint)


def test_missing_tensor_is_named(checkpoint):
    path = checkpoint / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing .*model\.layers\.1\.self_attn\.qkv_proj"):
        LLM(checkpoint)


def test_missing_shard_is_named(tmp_path):
    sharded_copy(build_checkpoint("qwen2", tmp_path / "single"), tmp_path / "sharded")
    shard = sorted((tmp_path / "sharded").glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        LLM(tmp_path / "sharded")


def test_prompt_over_the_context_length_fails_alone(tiny_llama):
    llm = LLM(tiny_llama, max_model_len=32, num_kv_blocks=64, block_size=4)
    prompts = [[1, 2, 3], list(range(40)), [4, 5, 6, 7]]
    good, bad, other = llm.generate(prompts, GREEDY)
    assert bad.finished and bad.outputs[0].finish_reason == "error"
    assert "40 tokens" in bad.error and "context length 32" in bad.error
    assert bad.outputs[0].token_ids == []
    assert len(good.outputs[0].token_ids) == 8 and len(other.outputs[0].token_ids) == 8
    assert good.error is None
    assert_no_block_in_use(llm)


def test_prompt_over_the_kv_cache_capacity_fails_alone(tiny_llama):
    llm = LLM(tiny_llama, num_kv_blocks=5, block_size=4)  # 20 token slots
    good, bad = llm.generate([[1, 2, 3], list(range(24))], GREEDY)
    assert bad.outputs[0].finish_reason == "error" and "KV cache" in bad.error
    assert len(good.outputs[0].token_ids) == 8
    assert_no_block_in_use(llm)


def test_generation_stops_at_the_context_length(tiny_llama):
    llm = LLM(tiny_llama, max_model_len=16, num_kv_blocks=64, block_size=4)
    output = llm.generate([list(range(10))], SamplingParams(max_tokens=100, ignore_eos=True))[0]
    assert output.outputs[0].finish_reason == "length"
    assert len(output.prompt_token_ids) + len(output.outputs[0].token_ids) == 16
    assert_no_block_in_use(llm)


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([], "prompt is empty"),
        ([1, 2, 999], "outside the vocabulary"),
        ([1, -3], "outside the vocabulary"),
        ([-1, 5], "outside the vocabulary"),
        ("text without a tokenizer", "no tokenizer.json"),
    ],
)
def test_unusable_prompts_fail_with_a_reason(tiny_llama, prompt, message):
    llm = LLM(tiny_llama, num_kv_blocks=32)
    bad, good = llm.generate([prompt, [1, 2]], GREEDY)
    assert bad.outputs[0].finish_reason == "error" and message in bad.error
    assert len(good.outputs[0].token_ids) == 8
    assert_no_block_in_use(llm)


def test_intake_checks_prompt_ids_before_anything_is_built_from_them():
    """A negative id would overflow the detokenizer's decode stream: intake refuses it
    first, so the request it makes holds no unchecked id (the server's API process and
    the engine build from it alike)."""
    tokenizer = Tokenizer.from_dir(DEMO_MODEL_DIR)
    vocab = tokenizer.vocab_size
    processor = InputProcessor(tokenizer, ModelLimits(str(DEMO_MODEL_DIR), 64, vocab, (), 64))
    for prompt in ([-1, 5], [5, 99_999_999]):
        intake = processor.process(prompt, GREEDY)
        assert "outside the vocabulary" in intake.error and intake.prompt_token_ids == []
        intake.build("r", intake.params, tokenizer)  # decodes nothing it was not given


def test_bad_ids_and_oversized_integers_fail_alone_naming_the_field(tiny_llama):
    """Each id outside the vocabulary, id that is not an integer, and integer past what
    the engine process can be sent (64 bits, a schema's constants included) fails its
    own request with a message naming the field and the value; numpy ids are ids."""
    schema = StructuredOutputsParams(json={"type": "object", "enum": [{"a": [1, 10**30]}]})
    cases = [
        ([-1, 5], GREEDY, "prompt: token id -1 at position 0 is outside the vocabulary"),
        ([1, 2**100], GREEDY, "prompt: token id 2**100 (or beyond) at position 1"),
        ([1, 2.0], GREEDY, "prompt: 2.0 at position 1 is not a token id"),
        ([1, 2], greedy(8, stop_token_ids=[2**80]), "stop_token_ids: token id 2**80"),
        ([1, 2], greedy(8, logit_bias={10**6: 1.0}), "logit_bias: key 1000000 is outside"),
        ([1, 2], greedy(8, allowed_token_ids=[5, 999]), "allowed_token_ids: token id 999 at "),
        ([1, 2], greedy(8, truncate_prompt_tokens=2**64), "truncate_prompt_tokens: the integer"),
        (
            [1, 2],
            greedy(8, structured_outputs=schema),
            "structured_outputs: the integer 2**99 (or beyond) at /enum/0/a/1 of its schema "
            "does not fit in 64 bits",
        ),
    ]
    llm = LLM(tiny_llama, num_kv_blocks=32)
    *bad, good = llm.generate(
        [prompt for prompt, _, _ in cases] + [[np.int64(1), np.int32(2)]],
        [params for _, params, _ in cases] + [GREEDY],
    )
    for output, (_, _, message) in zip(bad, cases, strict=True):
        assert output.outputs[0].finish_reason == "error"
        assert output.error.startswith(message), output.error
    assert good.error is None and len(good.outputs[0].token_ids) == 8
    assert_no_block_in_use(llm)


def test_bad_engine_arguments_are_named(tiny_llama):
    with pytest.raises(TypeError, match="unknown engine arguments"):
        LLM(tiny_llama, gpu_memory=3)
    with pytest.raises(ValueError, match="dtype"):
        LLM(tiny_llama, dtype="float8")
    with pytest.raises(ValueError, match="block_size"):
        LLM(tiny_llama, block_size=0)


def test_mismatched_sampling_params_are_refused(tiny_llama):
    llm = LLM(tiny_llama, num_kv_blocks=32)
    with pytest.raises(ValueError, match="2 sampling params for 3 prompts"):
        llm.generate([[1], [2], [3]], [GREEDY, GREEDY])
    with pytest.raises(TypeError, match="SamplingParams"):
        llm.generate([[1]], [dict(max_tokens=3)])
    assert_no_block_in_use(llm)


def test_longrope_without_its_factors_is_named(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0}
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="short_factor and long_factor"):
        LLM(checkpoint)
