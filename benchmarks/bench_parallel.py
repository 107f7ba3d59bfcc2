"""Tensor parallelism on this machine's cores: one process with every core against
``tensor_parallel_size=2`` (two processes, an equal share of the cores each), on the
random 100M Qwen3-style checkpoint, in float32 with captured steps.

Measures, per setup: batch-1 decode tokens/s (32-token prompt, 128 new tokens, prefill
excluded), output tokens/s of the peer benchmark's 32 mixed requests, and the time to
first token of one 2,048-token prompt. Each setup runs in a fresh process per round
(TP changes the process's thread count), rounds alternate the order; the table shows
the best round and the range. Every setup's tokens are compared with the first's.

    .venv/bin/python -m benchmarks.bench_parallel [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import make_random_qwen3, markdown_table
from benchmarks.peers.workload import batch1_prompt, mixed_requests

SETUPS = {"1 process, 2 threads": 1, "tensor_parallel_size=2": 2}
LONG_PROMPT = 2048


def measure(model: Path, tensor_parallel_size: int) -> dict:
    from updraft import LLM, SamplingParams

    llm = LLM(
        str(model),
        tensor_parallel_size=tensor_parallel_size,
        kv_cache_memory_gib=1,
        max_num_batched_tokens=2048,
        max_model_len=4096,
    )
    prompt = batch1_prompt()

    def generate(prompts, lengths):
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        return time.perf_counter() - start, [o.outputs[0].token_ids for o in outputs]

    generate([prompt], [128])  # warm-up
    one, _ = generate([prompt], [1])
    full, batch1_tokens = generate([prompt], [128])
    mixed = mixed_requests()
    mixed_seconds, mixed_tokens = generate([p for p, _ in mixed], [n for _, n in mixed])
    long_prompt = [random.Random(2).randrange(32000) for _ in range(LONG_PROMPT)]
    ttft, _ = generate([long_prompt], [1])
    return {
        "batch1": 127 / (full - one),
        "mixed": sum(n for _, n in mixed) / mixed_seconds,
        "ttft": ttft,
        "tokens": batch1_tokens + mixed_tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "peers")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    model = make_random_qwen3(args.work_dir / "qwen3-100m")
    if args.worker is not None:
        print(json.dumps(measure(model, args.worker)))
        return
    results: dict[str, list[dict]] = {name: [] for name in SETUPS}
    for round_ in range(args.rounds):
        order = list(SETUPS) if round_ % 2 == 0 else list(reversed(SETUPS))
        for name in order:
            command = [sys.executable, "-m", "benchmarks.bench_parallel", "--worker"]
            done = subprocess.run(
                [*command, str(SETUPS[name]), "--work-dir", str(args.work_dir)],
                capture_output=True,
                text=True,
                check=True,
            )
            result = json.loads(done.stdout.strip().splitlines()[-1])
            results[name].append(result)
            print(
                f"round {round_ + 1} {name}: batch 1 {result['batch1']:.1f} tok/s, "
                f"mixed {result['mixed']:.1f} tok/s, TTFT {result['ttft']:.2f} s",
                flush=True,
            )
    first = results[next(iter(SETUPS))][0]["tokens"]

    def cell(name: str, key: str, best=max, fmt="{:.1f}") -> str:
        values = [r[key] for r in results[name]]
        return (
            f"**{fmt.format(best(values))}** ({fmt.format(min(values))}-{fmt.format(max(values))})"
        )

    rows = [
        ["decode tokens/s, batch 1", *(cell(n, "batch1") for n in SETUPS)],
        ["output tokens/s, 32 mixed requests", *(cell(n, "mixed") for n in SETUPS)],
        [
            f"time to first token, {LONG_PROMPT}-token prompt, s",
            *(cell(n, "ttft", min, "{:.2f}") for n in SETUPS),
        ],
        [
            "same tokens as the first setup",
            *(str(all(r["tokens"] == first for r in results[n])) for n in SETUPS),
        ],
    ]
    title = f"tensor parallelism on 2 cores, 100m model, best of {args.rounds}"
    print(markdown_table(title, ["measure", *SETUPS], rows))


if __name__ == "__main__":
    main()
