"""The linear layers of a decode step with few rows: updraft's panel kernel
(``updraft::panel_linear`` on float32 panels) against oneDNN on a prepacked weight (what PyTorch's
freezing and vLLM's CPU backend run), PyTorch's own ``F.linear``, and the machine's
floor for reading the weights once (weight bytes / stream bandwidth).

One "pass" is every projection of a model once, each with its own weight, as a step
runs them: the demo model's (6 layers, hidden 256, 22 MB: it sits in cache) and the
random 100M checkpoint's (12 layers, hidden 768, 440 MB: streamed from memory). Rows
are a step's tokens: 1 for batch-1 decode, 1 + k for a speculative verify step. Each
setup runs in blocks of passes (warm-up, then 10 timed) so that, as in an engine that
reads one copy of its weights, its own copy is what the cache holds; blocks alternate
across 3 rounds, and each time is the best pass.

    .venv/bin/python -m benchmarks.bench_linear

``--bfloat16``: instead, one bfloat16 weight's batches, widened to float32 panel by
panel against bfloat16 products (x rounded to bfloat16, on a CPU with AVX512-BF16), on
the same panels, and oneDNN's bfloat16 matmul (``F.linear`` of bfloat16 x and weight,
which a packed model does not keep) for scale; each time the best of 5 blocks.
``--cpu-time`` (one thread) times the thread's CPU time rather than the wall clock: on a
machine others share, time the thread spends descheduled is left out (time spent
waiting on memory that others share is not).

    .venv/bin/python -m benchmarks.bench_linear --bfloat16 [--threads 1 --cpu-time]
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import torch
import torch.nn.functional as F

from benchmarks.common import markdown_table, stream_bandwidth
from updraft.kernels import ops
from updraft.kernels.panels import pack
from updraft.weights import WeightFormat

# (out, in) of each projection: fused qkv, o, fused gate_up, down per layer, then the head
MODELS = {
    "demo": [(512, 256), (256, 256), (1408, 256), (256, 704)] * 6 + [(4096, 256)],
    "100M": [(1280, 768), (768, 768), (4096, 768), (768, 2048)] * 12 + [(32000, 768)],
}
ROWS = (1, 2, 4, 6, 8, 12, 16, 32, 64)
ROUNDS = 3
WARM_UP = 3
PASSES = 10


def setups(shapes: list[tuple[int, int]]) -> dict:
    weights = [torch.randn(n, k) / k**0.5 for n, k in shapes]
    panels = [pack(w, WeightFormat("float32")) for w in weights]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in weights]
    return {
        "panel kernel": lambda xs: [
            torch.ops.updraft.panel_linear(
                xs[w.shape[1]], p.codes, None, None, None, 0, 0, w.shape[0]
            )
            for w, p in zip(weights, panels, strict=True)
        ],
        "oneDNN prepacked": lambda xs: [
            torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
            for w, p in zip(weights, onednn, strict=True)
        ],
        "F.linear": lambda xs: [F.linear(xs[w.shape[1]], w) for w in weights],
    }


# (out, in) of the bfloat16 weights, and the batch rows they take
BF16_SHAPES = [(1024, 4096), (4096, 1024)]
BF16_ROWS = (4, 8, 16, 64, 128, 256)


def best_seconds(run, work: float, clock=time.perf_counter) -> float:
    """The best time of one ``run()`` over 5 blocks of repeats of about ``work`` flops
    in all (a fraction of a second each), by ``clock``."""
    repeats = max(1, int(2e9 / work))
    run()
    best = float("inf")
    for _ in range(5):
        start = clock()
        for _ in range(repeats):
            run()
        best = min(best, (clock() - start) / repeats)
    return best


def bfloat16_batches(clock=time.perf_counter) -> None:
    start = ops.bf16_product_rows()
    print(f"bfloat16 products from {start} rows" if start else "no AVX512-BF16: products exact")
    for n, k in BF16_SHAPES:
        weight = torch.randn(n, k) / k**0.5
        panels = pack(weight, WeightFormat("bfloat16")).codes
        plain = weight.bfloat16()
        rows = []
        for count in BF16_ROWS:
            x = torch.randn(count, k)
            args = (x, panels, None, None, None)
            runs = {
                "widened to float32": partial(ops.panel_linear, *args, ops.BF16, 0, n),
                "bf16 products": partial(ops.panel_linear, *args, ops.BF16_PRODUCTS, 0, n),
                "oneDNN bf16 F.linear": partial(F.linear, x.bfloat16(), plain),
            }
            flops = 2 * count * n * k
            with torch.inference_mode():
                best = {name: best_seconds(run, flops, clock) for name, run in runs.items()}
            gflops = {name: flops / t / 1e9 for name, t in best.items()}
            rows.append(
                [str(count)]
                + [f"{1e3 * best[name]:.3f} ({gflops[name]:.0f})" for name in runs]
                + [f"{best['widened to float32'] / best['bf16 products']:.2f}x"]
            )
        header = ["rows", *(f"{name} ms (GFLOP/s)" for name in runs), "products vs widened"]
        print(markdown_table(f"a bfloat16 [{n}, {k}] weight's batches", header, rows))
        print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bfloat16", action="store_true", help="bfloat16 batches instead")
    parser.add_argument("--threads", type=int, default=None, help="torch's thread count")
    parser.add_argument("--cpu-time", action="store_true", help="the thread's CPU time")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cpu_time and torch.get_num_threads() != 1:
        parser.error("--cpu-time times one thread: add --threads 1")
    if args.bfloat16:
        bfloat16_batches(time.thread_time if args.cpu_time else time.perf_counter)
        return
    bandwidth = stream_bandwidth()
    print(f"stream bandwidth {bandwidth / 1e9:.1f} GB/s")
    for name, shapes in MODELS.items():
        runs = setups(shapes)
        floor_ms = sum(4 * n * k for n, k in shapes) / bandwidth * 1e3
        rows = []
        for count in ROWS:
            xs = {k: torch.randn(count, k) for _, k in shapes}
            best = dict.fromkeys(runs, float("inf"))
            with torch.inference_mode():
                for _ in range(ROUNDS):
                    for setup, run in runs.items():
                        for _ in range(WARM_UP):
                            run(xs)
                        for _ in range(PASSES):
                            start = time.perf_counter()
                            run(xs)
                            best[setup] = min(best[setup], time.perf_counter() - start)
            panel = best["panel kernel"]
            rows.append(
                [str(count)]
                + [f"{1e3 * t:.3f}" for t in best.values()]
                + [f"{best['oneDNN prepacked'] / panel:.2f}x", f"{floor_ms:.3f}"]
            )
        header = ["rows", *(f"{s} ms" for s in runs), "panel vs oneDNN", "read floor ms"]
        print(markdown_table(f"linear layers of one {name} pass", header, rows))
        print()


if __name__ == "__main__":
    main()
