"""The workload every engine of the peer benchmark runs, and how a worker reports.

Standard library only: the peers' workers run in their own virtual environments, which
have neither updraft nor its benchmarks package, and import this file by path.

A worker process loads one engine, runs the workload named on its command line and
prints one JSON line: the measures, the tokens it generated (so the orchestrator can
check that every engine produced the same greedy output) and its peak resident memory.
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import time
from collections.abc import Callable

VOCAB = 32000
BATCH1_PROMPT_TOKENS = 32
BATCH1_NEW_TOKENS = 128
MIXED_REQUESTS = 32
MIXED_PROMPT_TOKENS = (16, 256)
MIXED_OUTPUT_TOKENS = (16, 128)
KV_CACHE_GIB = 1  # the same KV capacity for every engine
MAX_NUM_SEQS = 64
MAX_NUM_BATCHED_TOKENS = 2048
# Cold prefill of whole 256-token prompts, one at a time, as llama-bench's pp256 runs
PREFILL_PROMPT_TOKENS = 256
PREFILL_PROMPTS = 8


def batch1_prompt(vocab: int = VOCAB) -> list[int]:
    rng = random.Random(0)
    return [rng.randrange(vocab) for _ in range(BATCH1_PROMPT_TOKENS)]


def mixed_requests(vocab: int = VOCAB, quick: bool = False) -> list[tuple[list[int], int]]:
    """(prompt token ids, output tokens) of the mixed load."""
    rng = random.Random(1)
    count = 8 if quick else MIXED_REQUESTS
    top = 32 if quick else MIXED_OUTPUT_TOKENS[1]
    return [
        (
            [rng.randrange(vocab) for _ in range(rng.randint(*MIXED_PROMPT_TOKENS))],
            rng.randint(MIXED_OUTPUT_TOKENS[0], top),
        )
        for _ in range(count)
    ]


def cold_prompts(vocab: int, run: int, quick: bool = False) -> list[list[int]]:
    """The mixed load's prompt lengths with fresh tokens for each ``run``: no run can
    reuse another's prefix cache."""
    rng = random.Random(1000 + run)
    lengths = [len(prompt) for prompt, _ in mixed_requests(vocab, quick)]
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def cold_256_prompts(vocab: int, run: int, quick: bool = False) -> list[list[int]]:
    """``PREFILL_PROMPTS`` fresh prompts of ``PREFILL_PROMPT_TOKENS`` tokens for each ``run``."""
    rng = random.Random(3000 + run)
    count = 2 if quick else PREFILL_PROMPTS
    return [[rng.randrange(vocab) for _ in range(PREFILL_PROMPT_TOKENS)] for _ in range(count)]


def peak_rss_mib() -> float:
    """This process's peak resident memory (VmHWM), MiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def best_time(fn: Callable[[], object], repeats: int = 1) -> float:
    """Best wall time of ``repeats`` runs after one warm-up run."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def parse_args(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", required=True, help="checkpoint directory (or GGUF file)")
    parser.add_argument(
        "--workload", choices=["batch1", "mixed", "prefill", "prefill256"], required=True
    )
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--option", action="append", default=[], help="engine option k=v")
    return parser.parse_args()


def options(args: argparse.Namespace) -> dict[str, object]:
    """``--option k=v`` pairs; a value is a Python literal where it parses as one."""
    parsed: dict[str, object] = {}
    for item in args.option:
        key, _, value = item.partition("=")
        try:
            parsed[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            parsed[key] = value
    return parsed


def run_workload(
    args: argparse.Namespace,
    engine: str,
    generate: Callable[[list[list[int]], list[int]], list[list[int]]],
    load_seconds: float,
) -> None:
    """Time ``generate(prompts, output_lengths) -> token ids per prompt`` on the
    workload and print the report line. Batch 1 counts decode only:
    (N - 1) / (t(N) - t(1))."""
    report: dict[str, object] = {"engine": engine, "load_seconds": load_seconds}
    if args.workload == "batch1":
        prompt = batch1_prompt(args.vocab)
        new = 16 if args.quick else BATCH1_NEW_TOKENS
        full = best_time(lambda: generate([prompt], [new]), args.repeats)
        first = best_time(lambda: generate([prompt], [1]), args.repeats)
        report["tokens_per_second"] = (new - 1) / (full - first)
        report["tokens"] = generate([prompt], [new])
    elif args.workload == "prefill":  # cold: fresh prompts every run, one token each
        runs = iter(range(1 + args.repeats))

        def prefill() -> list[list[int]]:
            prompts = cold_prompts(args.vocab, next(runs), args.quick)
            report["prompt_tokens"] = sum(map(len, prompts))
            return generate(prompts, [1] * len(prompts))

        seconds = best_time(prefill, args.repeats)
        report["tokens_per_second"] = report["prompt_tokens"] / seconds
        report["tokens"] = []  # one token each: nothing worth comparing across engines
    elif args.workload == "prefill256":  # one whole prompt a step, as a lone user's
        runs = iter(range(1 + args.repeats))

        def prefill_each() -> None:
            for prompt in cold_256_prompts(args.vocab, next(runs), args.quick):
                generate([prompt], [1])

        seconds = best_time(prefill_each, args.repeats)
        count = 2 if args.quick else PREFILL_PROMPTS
        report["prompt_tokens"] = count * PREFILL_PROMPT_TOKENS
        report["tokens_per_second"] = report["prompt_tokens"] / seconds
        report["tokens"] = []
    else:
        requests = mixed_requests(args.vocab, args.quick)
        prompts = [p for p, _ in requests]
        lengths = [n for _, n in requests]
        seconds = best_time(lambda: generate(prompts, lengths), args.repeats)
        report["tokens_per_second"] = sum(lengths) / seconds
        report["tokens"] = generate(prompts, lengths)
    report["peak_rss_mib"] = peak_rss_mib()
    print("REPORT " + json.dumps(report), flush=True)
