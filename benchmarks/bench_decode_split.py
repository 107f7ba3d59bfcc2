"""Where a batch-1 decode step's time goes, on a GGUF file with updraft's defaults (as
``bench_peers`` runs it: captured, compiled graphs): each quantized linear (calls and
milliseconds per step, and its weights' bytes per second), attention, the KV write,
the graph's other ops (norms, RoPE, activations, residuals: inductor's fused runs),
and the step outside the graph's replay (scheduling, sampling, outputs).

The kernel calls a replay makes straight into C are timed one by one (``Launch``), the
replay and the step whole; the rest is their difference. The timing itself costs about
0.2 us a call.

    .venv/bin/python -m benchmarks.bench_decode_split --model FILE.gguf [--tokens 128]
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from pathlib import Path

from benchmarks.common import markdown_table
from benchmarks.peers import workload
from updraft import LLM, SamplingParams
from updraft.graph.recorded import RecordedGraph
from updraft.kernels.launch import Launch

GROUP_ROWS = 8


class Timings:
    """Seconds and calls per kernel, and per replay, while ``on``."""

    def __init__(self) -> None:
        self.on = False
        self.kernels: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0])
        self.replays: list[float] = []

    def install(self) -> None:
        call, replay = Launch.__call__, RecordedGraph.replay
        timings = self

        def timed_call(launch: Launch):
            if not timings.on:
                return call(launch)
            start = time.perf_counter()
            out = call(launch)
            entry = timings.kernels[kernel_name(launch)]
            entry[0] += 1
            entry[1] += time.perf_counter() - start
            entry[2] += weight_bytes(launch)
            return out

        def timed_replay(graph, *args, **kwargs):
            start = time.perf_counter()
            replay(graph, *args, **kwargs)
            if timings.on:
                timings.replays.append(time.perf_counter() - start)

        Launch.__call__ = timed_call
        RecordedGraph.replay = timed_replay


def kernel_name(launch: Launch) -> str:
    name = getattr(launch.function, "__name__", "kernel")
    if name in ("gguf_linear_int8", "gguf_linear"):
        k, n = launch.arguments[3], launch.arguments[5]
        return f"{name}, type {launch.arguments[0]}, {k} -> {n}"
    return name


def weight_bytes(launch: Launch) -> int:
    """Bytes of weights a linear's call reads (its groups), else 0."""
    if getattr(launch.function, "__name__", "") != "gguf_linear_int8":
        return 0
    n, group_bytes = launch.arguments[5], launch.arguments[6]
    return -(-n // GROUP_ROWS) * group_bytes


def split(path: str, tokens: int) -> tuple[list[list[str]], float]:
    timings = Timings()
    timings.install()
    settings = {
        "dtype": "float32",
        "kv_cache_memory_gib": workload.KV_CACHE_GIB,
        "max_num_seqs": workload.MAX_NUM_SEQS,
        "max_num_batched_tokens": workload.MAX_NUM_BATCHED_TOKENS,
    }
    llm = LLM(path, **settings)
    prompt = [workload.batch1_prompt()]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate(prompt, params)  # warm-up
    engine, steps = llm.engine, []
    engine.add_request(prompt[0], params)
    engine.step()  # the prefill, not timed
    timings.on = True
    while engine.has_unfinished:
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    timings.on = False
    count = len(steps)
    per_step = lambda seconds: f"{seconds / count * 1e3:.3f}"  # noqa: E731
    rows, in_kernels = [], 0.0
    for name, (calls, seconds, nbytes) in sorted(timings.kernels.items(), key=lambda i: -i[1][1]):
        rate = f"{nbytes / seconds / 1e9:.1f}" if nbytes else "-"
        rows.append([name, f"{calls / count:.0f}", per_step(seconds), rate])
        in_kernels += seconds
    replayed = sum(timings.replays)
    rows.append(["other ops in the graph (fused runs)", "-", per_step(replayed - in_kernels), "-"])
    rows.append(["outside the replay (host, sampling)", "-", per_step(sum(steps) - replayed), "-"])
    rows.append(["step", "-", per_step(sum(steps)), "-"])
    return rows, count / sum(steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", required=True, help="a GGUF file")
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    for path in args.model:
        rows, rate = split(path, args.tokens)
        title = f"a batch-1 decode step of {Path(path).name}, {rate:.1f} tok/s"
        header = ["part", "calls a step", "ms a step", "weights GB/s"]
        print(markdown_table(title, header, rows))


if __name__ == "__main__":
    main()
