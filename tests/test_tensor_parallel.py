"""Tensor parallelism over worker processes (gloo on the CPU): two ranks compute what one
process computes, token for token and logit for logit, eager and with graphs."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers

from tests.conftest import TINY, make_tiny_checkpoint
from tests.probes import LogitsProbe, assert_idle
from updraft import LLM, SamplingParams, WorkerPool
from updraft.demo import DEMO_DRAFT_DIR, DEMO_MODEL_DIR

# Prompts that end mid-block and cross block boundaries (block size 4), a repetitive
# one for prompt lookup, and one longer than the chunked-prefill budget below.
PROMPTS = [list(range(10, 31)), [5, 6, 7] * 5, list(range(100, 137)), list(range(1, 60))]
PARAMS = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (14, 9, 11, 6)]
ARGS = dict(block_size=4, num_kv_blocks=256, max_num_batched_tokens=32)


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def run(checkpoint, pool=None, **args):
    """Outputs and the logits each token was drawn from; the other ranks are back in
    ``pool`` when it returns."""
    llm = LLM(str(checkpoint), pool, **ARGS, **args)
    probe = LogitsProbe(llm)
    outputs = llm.generate(PROMPTS, PARAMS)
    logits = [probe.of(output) for output in outputs]
    assert_idle(llm)
    llm.engine.close()
    return llm, outputs, logits


@pytest.fixture(scope="module")
def pool():
    """Worker processes the module's engines share, one engine after another."""
    workers = WorkerPool()
    yield workers
    workers.close()


@pytest.fixture(scope="module")
def odd_vocabulary(tmp_path_factory):
    """A Llama whose 257-token vocabulary does not split evenly over 2 ranks."""
    directory = tmp_path_factory.mktemp("odd_vocab")
    config = transformers.LlamaConfig(**{**TINY, "vocab_size": 257}, num_key_value_heads=2)
    torch.manual_seed(3)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(directory)
    return directory


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
def test_two_ranks_compute_what_one_process_computes(tiny_checkpoint, enforce_eager, pool):
    """Llama (GQA, 2 KV heads: one per rank), Qwen2 (one KV head, kept by both ranks,
    tied embeddings, q/k/v bias) and Qwen3 (q/k norms): greedy tokens identical, logits
    within 1e-4, with chunked prefill over block boundaries."""
    _, checkpoint = tiny_checkpoint
    _, plain, plain_logits = run(checkpoint, enforce_eager=enforce_eager)
    llm, split, split_logits = run(
        checkpoint, pool, enforce_eager=enforce_eager, tensor_parallel_size=2
    )
    assert tokens(split) == tokens(plain)
    for ours, reference in zip(split_logits, plain_logits, strict=True):
        torch.testing.assert_close(ours, reference, atol=1e-4, rtol=0)
    steps = llm.engine.stats().steps
    assert ("graph" in steps) != enforce_eager, steps


def test_a_vocabulary_that_does_not_split_evenly(odd_vocabulary, pool):
    _, plain, plain_logits = run(odd_vocabulary)
    _, split, split_logits = run(odd_vocabulary, pool, tensor_parallel_size=2)
    assert tokens(split) == tokens(plain)
    for ours, reference in zip(split_logits, plain_logits, strict=True):
        assert ours.shape[-1] == 257
        torch.testing.assert_close(ours, reference, atol=1e-4, rtol=0)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculation_keeps_greedy_output_and_acceptance(method, pool):
    """The proposer runs on rank 0 only (the draft model unsplit); verify steps replay
    on every rank."""
    args = dict(speculative_method=method, num_speculative_tokens=3)
    if method == "draft":
        args["speculative_model"] = str(DEMO_DRAFT_DIR)
    prompts = [[10 + i, 11 + i, 12 + i] * 6 for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    results = []
    for size in (1, 2):
        llm = LLM(str(DEMO_MODEL_DIR), pool, tensor_parallel_size=size, **args)
        outputs = llm.generate(prompts, params)
        stats = llm.engine.stats()
        results.append((tokens(outputs), stats.speculative.accepted, stats.speculative.proposed))
        assert_idle(llm)
        llm.engine.close()
    assert results[0] == results[1]
    assert sum(results[1][1]) > 0


def test_a_closed_engine_stops_its_workers_and_a_dead_worker_is_named(tiny_llama):
    llm = LLM(str(tiny_llama), **ARGS, tensor_parallel_size=2)
    workers = llm.engine._workers
    llm.generate(PROMPTS[:1], PARAMS[:1])
    workers.processes[0].kill()
    workers.processes[0].join()
    with pytest.raises(RuntimeError, match="updraft-rank-1 exited"):
        llm.generate(PROMPTS[:1], PARAMS[:1])
    workers.close()
    other = LLM(str(tiny_llama), **ARGS, tensor_parallel_size=2)
    processes = other.engine._workers.processes
    other.engine._workers.close()
    assert not any(p.is_alive() for p in processes)


def test_models_and_settings_tensor_parallelism_cannot_split_are_refused(tiny_llama):
    with pytest.raises(ValueError, match="does not divide this model's 4 attention heads"):
        LLM(str(tiny_llama), tensor_parallel_size=3)
    with pytest.raises(ValueError, match="'eagle' reads the target's embedding"):
        LLM(speculative_method="eagle", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an int >= 1"):
        LLM(str(tiny_llama), tensor_parallel_size=0)


def test_shards_hold_their_rank_s_heads(tmp_path, pool):
    """Each rank's KV cache holds its own KV heads: 4 over 2 ranks is 2 per rank."""
    checkpoint = make_tiny_checkpoint("qwen3", tmp_path / "qwen3")
    llm = LLM(str(checkpoint), pool, **ARGS, tensor_parallel_size=2)
    runner = llm.engine._runner
    assert runner.kv_caches[0].shape[-2] == 2
    assert runner.model.model.layers[0].self_attn.num_heads == 2
    llm.engine.close()


def test_torchrun_ranks_serve_one_engine(tiny_llama_with_tokenizer):
    """``torchrun --nproc-per-node 2 -m updraft generate ...``: rank 0 is the engine and
    prints the text; rank 1 runs its shard's steps and exits; the text is one
    process's."""
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [
        "-m",
        "updraft",
        "generate",
        "--model",
        str(tiny_llama_with_tokenizer),
        "--prompt",
        "hello",
        "--max-tokens",
        "12",
        "--temperature",
        "0",
        "--ignore-eos",
    ]
    alone = subprocess.run(
        [sys.executable, *command], capture_output=True, text=True, timeout=120, check=True
    )
    ranks = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node", "2", *command],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert ranks.returncode == 0, ranks.stderr[-3000:]
    assert ranks.stdout == alone.stdout
    assert alone.stdout.strip()


def process_lives(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def test_workers_exit_when_the_engine_process_is_killed(tiny_llama):
    """SIGKILL gives the engine no chance to stop its workers: each notices, in its
    wait for the next step, that rank 0's process is gone, and exits."""
    script = f"""
import time
from updraft import LLM
if __name__ == "__main__":
    llm = LLM({str(tiny_llama)!r}, num_kv_blocks=16, tensor_parallel_size=2, enforce_eager=True)
    print(llm.engine._workers.processes[0].pid, flush=True)
    time.sleep(600)
"""
    engine = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        worker = int(engine.stdout.readline())
        assert process_lives(worker)
    finally:
        engine.kill()
        engine.wait()
    deadline = time.monotonic() + 60
    while process_lives(worker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not process_lives(worker)
