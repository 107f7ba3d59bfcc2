"""The shipped demo models and the ``updraft`` command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from safetensors import safe_open

from tests.helpers import greedy
from updraft import LLM
from updraft.cli import main
from updraft.demo import DEMO_DRAFT_DIR, DEMO_MODEL_DIR

DEMO_ROOT = DEMO_MODEL_DIR.parent


def test_demo_assets_are_small_float16_llama_checkpoints():
    total = sum(p.stat().st_size for p in DEMO_ROOT.rglob("*") if p.is_file())
    assert total <= 25 * 2**20
    parameters = {}
    for model_dir in (DEMO_MODEL_DIR, DEMO_DRAFT_DIR):
        config = json.loads((model_dir / "config.json").read_text())
        assert config["architectures"] == ["LlamaForCausalLM"]
        with safe_open(str(model_dir / "model.safetensors"), "pt") as weights:
            tensors = [weights.get_tensor(name) for name in weights.keys()]  # noqa: SIM118
        assert {str(t.dtype) for t in tensors} == {"torch.float16"}
        parameters[model_dir.name] = sum(t.numel() for t in tensors)
    assert 4e6 <= parameters["target"] <= 6.5e6
    assert 1e6 <= parameters["draft"] <= 2e6
    target_tokenizer = (DEMO_MODEL_DIR / "tokenizer.json").read_bytes()
    assert (DEMO_DRAFT_DIR / "tokenizer.json").read_bytes() == target_tokenizer


@pytest.mark.parametrize("model_dir", [DEMO_MODEL_DIR, DEMO_DRAFT_DIR])
def test_demo_models_write_python(model_dir):
    llm = LLM(model_dir)
    params = greedy(40)
    text = llm.generate("def fibonacci(n):", params)[0].outputs[0].text
    # Trained on the standard library, they continue a def with an indented body.
    assert "\n    " in text and text.isascii()


def test_generate_command_streams_text_and_a_summary(capsys):
    assert main(["generate", "--prompt", "class ", "--max-tokens", "12", "--ignore-eos"]) == 0
    captured = capsys.readouterr()
    reference = LLM().generate("class ", greedy(12))
    assert captured.out == reference[0].outputs[0].text + "\n"
    assert "[updraft] 12 tokens in" in captured.err
    assert "tokens/s" in captured.err and "time to first token" in captured.err
    assert "[updraft] steps: 1 eager (prefill), 11 graph" in captured.err


def test_generate_command_can_replay_captured_decode_steps(capsys):
    argv = ["generate", "--prompt", "class ", "--max-tokens", "12", "--ignore-eos"]
    assert main([*argv, "--no-enforce-eager"]) == 0
    graph = capsys.readouterr()
    assert main(argv) == 0
    assert graph.out == capsys.readouterr().out
    assert "steps: 1 eager (prefill), 11 graph" in graph.err


def test_generate_command_reports_bad_input_without_a_traceback(capsys, tmp_path):
    assert main(["generate", "--prompt", "x", "--model", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert main(["generate", "--prompt", "x", "--top-p", "2"]) == 2
    assert "SamplingParams.top_p" in capsys.readouterr().err


def test_a_one_shot_generate_exits_cleanly_while_graphs_are_made_in_the_background():
    """The default start steps eagerly while a thread captures graphs; a run that ends
    before that thread does must still exit 0 (a daemon thread left inside torch's C++
    at interpreter exit aborts the process)."""
    env = {**os.environ, "UPDRAFT_GRAPHS_IN_BACKGROUND": "1", "UPDRAFT_COMPILE_GRAPHS": "0"}
    result = subprocess.run(
        [sys.executable, "-m", "updraft", "generate", "--prompt", "x", "--max-tokens", "1"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "terminate called" not in result.stderr


def test_help_is_useful_on_its_own():
    result = subprocess.run(
        [sys.executable, "-m", "updraft", "generate", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    for flag in ("--prompt", "--model", "--max-tokens", "--temperature", "--dtype", "--seed"):
        assert flag in result.stdout


def test_every_engine_setting_is_a_flag_that_reaches_the_config():
    from dataclasses import fields

    from updraft.cli import build_parser, engine_kwargs
    from updraft.config import EngineConfig

    values = {
        "--dtype": "float32",
        "--device": "cpu",
        "--quantization": "int4",
        "--quantization-group-size": "32",
        "--activations": "int8",
        "--seed": "7",
        "--block-size": "8",
        "--kv-cache-memory-gib": "0.5",
        "--num-kv-blocks": "77",
        "--kv-cache-dtype": "int8",
        "--num-prefix-states": "4",
        "--mamba-cache-dtype": "bfloat16",
        "--max-num-seqs": "3",
        "--max-num-batched-tokens": "99",
        "--max-model-len": "512",
        "--capture-sizes": "1,3",
        "--capture-tokens": "24,48",
        "--graph-mode": "full",
        "--speculative-method": "ngram",
        "--speculative-model": "somewhere",
        "--num-speculative-tokens": "5",
        "--tensor-parallel-size": "2",
        "--draft-tensor-parallel-size": "2",
        "--prefill-context-parallel-size": "3",
        "--decode-context-parallel-size": "2",
        "--probe": "records",
    }
    switches = [
        "--no-enable-prefix-caching",
        "--no-kv-pools-per-kind",
        "--prefix-cache-evicts-first",
        "--enforce-eager",
        "--sanitize",
        "--no-speculative-enforce-eager",
        "--no-adaptive-threads",
        "--no-keep-freed-memory",
        "--no-mmap",
        "--mlock",
        "--no-compile-graphs",
        "--no-graphs-in-background",
        "--overlap-grammar-masks",
    ]
    argv = ["doctor", *[part for pair in values.items() for part in pair], *switches]
    args = build_parser().parse_args(argv)
    kwargs = engine_kwargs(args)
    assert set(kwargs) | {"model"} == {f.name for f in fields(EngineConfig)}
    assert kwargs == {
        "dtype": "float32",
        "device": "cpu",
        "quantization": "int4",
        "quantization_group_size": 32,
        "activations": "int8",
        "adaptive_threads": False,
        "keep_freed_memory": False,
        "mmap": False,
        "mlock": True,
        "seed": 7,
        "overlap_grammar_masks": True,
        "block_size": 8,
        "kv_cache_memory_gib": 0.5,
        "num_kv_blocks": 77,
        "kv_cache_dtype": "int8",
        "num_prefix_states": 4,
        "mamba_cache_dtype": "bfloat16",
        "max_num_seqs": 3,
        "max_num_batched_tokens": 99,
        "max_model_len": 512,
        "capture_sizes": (1, 3),
        "capture_tokens": (24, 48),
        "graph_mode": "full",
        "speculative_method": "ngram",
        "speculative_model": "somewhere",
        "num_speculative_tokens": 5,
        "enable_prefix_caching": False,
        "kv_pools_per_kind": False,
        "prefix_cache_evicts_first": True,
        "enforce_eager": True,
        "compile_graphs": False,
        "graphs_in_background": False,
        "sanitize": True,
        "speculative_enforce_eager": False,
        "tensor_parallel_size": 2,
        "draft_tensor_parallel_size": 2,
        "prefill_context_parallel_size": 3,
        "decode_context_parallel_size": 2,
        "probe": "records",
    }
    defaults = engine_kwargs(build_parser().parse_args(["doctor"]))
    config = EngineConfig(model="m")
    assert defaults == {name: getattr(config, name) for name in defaults}
