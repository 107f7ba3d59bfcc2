"""A batch-1 decode step with each compiled run called through inductor's wrapper, and
with its kernels bound at capture (``graph/frozen_calls.py``), in one process.

Two engines on the same GGUF file, one per way, step in turns: each round decodes
``--tokens`` tokens on each, so the machine's load falls on both alike. Per way it
prints the Python calls, buffer allocations and views a decode step makes (counted,
so they hold under any load) and the median step time over the rounds, and checks that
both decoded the same tokens.

    .venv/bin/python -m benchmarks.bench_replay_calls --model FILE.gguf [--tokens 64 --rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import Counter

from benchmarks.common import markdown_table
from benchmarks.peers import workload

WAYS = ("wrapper", "bound")


def build(path: str, way: str):
    from updraft import LLM
    from updraft.graph import frozen_calls, run_store

    record, load = frozen_calls.record, run_store.load
    if way == "wrapper":  # no run recorded as its kernel calls, nor loaded as kept ones
        frozen_calls.record = run_store.load = lambda *args: None
    try:
        return LLM(
            path,
            dtype="float32",
            kv_cache_memory_gib=workload.KV_CACHE_GIB,
            max_num_seqs=workload.MAX_NUM_SEQS,
            max_num_batched_tokens=workload.MAX_NUM_BATCHED_TOKENS,
        )
    finally:
        frozen_calls.record, run_store.load = record, load


def decode(llm, tokens: int, counted: bool = False) -> tuple[list[float], list[int], Counter]:
    """Step times of a batch-1 decode of ``tokens`` tokens, its tokens, and (``counted``)
    the calls its decode steps made."""
    from updraft import SamplingParams

    engine, params = llm.engine, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    request = engine.add_request(workload.batch1_prompt(), params)
    engine.step()  # the prefill
    calls: Counter = Counter()
    # inductor's buffer allocations and views of them, builtins known by name
    watched = {"_empty_strided_cpu": "allocations", "_reinterpret_tensor": "views"}

    def count(frame, event, arg):
        if event == "call":
            calls["Python calls"] += 1
        elif event == "c_call" and arg.__name__ in watched:
            calls[watched[arg.__name__]] += 1

    times, outputs = [], []
    while engine.has_unfinished:
        sys.setprofile(count if counted else None)
        start = time.perf_counter()
        outputs.extend(engine.step())
        times.append(time.perf_counter() - start)
        sys.setprofile(None)
    finished = [output for output in outputs if output.request_id == request and output.finished]
    return times, list(finished[-1].outputs[0].token_ids), calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a GGUF file")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    os.environ["UPDRAFT_GRAPHS_IN_BACKGROUND"] = "0"  # both captured before the first step
    engines = {way: build(args.model, way) for way in WAYS}
    rows, tokens = [], {}
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    counts = {}
    for way, llm in engines.items():
        _, tokens[way], calls = decode(llm, args.tokens, counted=True)
        counts[way] = {name: number / (args.tokens - 1) for name, number in calls.items()}
    for _ in range(args.rounds):
        for way, llm in engines.items():
            times[way].extend(decode(llm, args.tokens)[0])
    for way in WAYS:
        step = statistics.median(times[way]) * 1e3
        count = counts[way]
        rows.append(
            [way, f"{step:.3f}"]
            + [f"{count.get(name, 0):.0f}" for name in ("Python calls", "allocations", "views")]
        )
    title = f"batch-1 decode steps of {os.path.basename(args.model)}, {args.rounds} rounds"
    header = ["compiled runs", "median ms a step", "Python calls", "allocations", "views"]
    print(markdown_table(title, header, rows))
    same = tokens["wrapper"] == tokens["bound"]
    print(f"same {len(tokens['bound'])} tokens:", "yes" if same else f"NO\n{tokens}")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
