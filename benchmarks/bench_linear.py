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
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from benchmarks.common import markdown_table, stream_bandwidth
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


def main() -> None:
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
