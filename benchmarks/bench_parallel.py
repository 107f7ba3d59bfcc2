"""Tensor and context parallelism on this machine's cores: one process with every core
against two processes with an equal share each, on a random 100M Qwen3-style checkpoint
with 16,384 positions, in float32 with captured steps.

Setups: one process; ``tensor_parallel_size=2``; TP=2 with
``decode_context_parallel_size=2`` (each rank keeps every other position of every
context); ``prefill_context_parallel_size=2`` (each rank runs half of every long
prefill, and K/V are all-gathered per layer).

Measures, per setup: batch-1 decode tokens/s (32-token prompt, 128 new tokens, prefill
excluded), output tokens/s of the peer benchmark's 32 mixed requests, and the time to
first token of one 2,048- and one 8,192-token prompt (prefilled in chunks of 2,048).
Each setup runs in a fresh process per round (parallelism changes the process's thread
count), rounds alternate the order; the table shows the best round and the range. Every
setup's tokens are compared with the first's.

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

SETUPS = {
    "1 process, 2 threads": {},
    "TP=2": {"tensor_parallel_size": 2},
    "TP=2, DCP=2": {"tensor_parallel_size": 2, "decode_context_parallel_size": 2},
    "PCP=2": {"prefill_context_parallel_size": 2},
}
LONG_PROMPTS = (2048, 8192)


def measure(model: Path, layout: dict) -> dict:
    from updraft import LLM, SamplingParams

    llm = LLM(
        str(model),
        kv_cache_memory_gib=1,
        max_num_batched_tokens=2048,
        max_model_len=LONG_PROMPTS[-1] + 64,
        **layout,
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
    result = {
        "batch1": 127 / (full - one),
        "mixed": sum(n for _, n in mixed) / mixed_seconds,
        "tokens": batch1_tokens + mixed_tokens,
    }
    for length in LONG_PROMPTS:
        long_prompt = [random.Random(length).randrange(32000) for _ in range(length)]
        result[f"ttft{length}"], first = generate([long_prompt], [1])
        result["tokens"] += first
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "peers")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    model = make_random_qwen3(args.work_dir / "qwen3-100m-16k", max_positions=16384)
    if args.worker is not None:
        print(json.dumps(measure(model, SETUPS[args.worker])))
        return
    results: dict[str, list[dict]] = {name: [] for name in SETUPS}
    for round_ in range(args.rounds):
        order = list(SETUPS) if round_ % 2 == 0 else list(reversed(SETUPS))
        for name in order:
            command = [sys.executable, "-m", "benchmarks.bench_parallel", "--worker", name]
            done = subprocess.run(
                [*command, "--work-dir", str(args.work_dir)],
                capture_output=True,
                text=True,
                check=True,
            )
            result = json.loads(done.stdout.strip().splitlines()[-1])
            results[name].append(result)
            ttfts = ", ".join(f"TTFT {n} {result[f'ttft{n}']:.2f} s" for n in LONG_PROMPTS)
            print(
                f"round {round_ + 1} {name}: batch 1 {result['batch1']:.1f} tok/s, "
                f"mixed {result['mixed']:.1f} tok/s, {ttfts}",
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
        *(
            [
                f"time to first token, {length}-token prompt, s",
                *(cell(n, f"ttft{length}", min, "{:.2f}") for n in SETUPS),
            ]
            for length in LONG_PROMPTS
        ),
        [
            "same tokens as the first setup",
            *(str(all(r["tokens"] == first for r in results[n])) for n in SETUPS),
        ],
    ]
    title = f"tensor and context parallelism on 2 cores, 100m model, best of {args.rounds}"
    print(markdown_table(title, ["measure", *SETUPS], rows))


if __name__ == "__main__":
    main()
