"""The linears of one batch-1 decode step, straight from memory: every linear of the
500M Qwen3-shape model (24 layers of q/k/v, o, gate/up and down, and the tied head),
each its own weight in one GGUF block type, ``gguf_linear_int8`` on one row of x one
after another, as a decode step calls them. Reported as the weights' bytes per second
of the whole pass, the figure a decode step's linears reach against the machine's
stream bandwidth (``bench_int8_gemm`` times one linear at a time, from the cache).

``--pages``: the weights in the pages the engine gives them (``huge``: 2 MiB,
``kernels/huge_pages.py``) and/or in torch's own (``4k``). ``--against REV``: the kernel
at git revision REV too. Kernels and pages alternate pass by pass, so that a machine
others share slows each alike; each is the best of ``--passes`` passes (and the median).

    .venv/bin/python -m benchmarks.bench_decode_pass [--types Q8_0,Q4_0] [--against REV] \\
        [--pages huge,4k] [--threads 2] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.bench_int8_gemm import TYPES, _typed, kernel_at
from benchmarks.common import markdown_table
from tests.test_gguf import random_blocks
from updraft.kernels import build
from updraft.kernels.gguf_ops import BLOCK_TYPES, gguf_group
from updraft.kernels.huge_pages import huge_page_empty

# (n, k) of a 500M layer's fused linears: q/k/v, o, gate/up, down; and the head
LAYER = ((2560, 1536), (1536, 1536), (8192, 1536), (1536, 4096))
HEAD = (32000, 1536)
LAYERS = 24


def pass_weights(kind: str, pages: str, layers: int) -> list[tuple[torch.Tensor, int, int]]:
    """(groups, n, k) of every linear of a decode step, each weight its own copy."""
    code = BLOCK_TYPES[kind]
    made = {}
    for n, k in {*LAYER, HEAD}:
        blocks = random_blocks(kind, n, k, np.random.default_rng(n + k))
        made[n, k] = gguf_group(torch.from_numpy(blocks), code, k)
    shapes = [shape for _ in range(layers) for shape in LAYER] + [HEAD]
    linears = []
    for n, k in shapes:
        groups = made[n, k]
        copy = huge_page_empty(*groups.shape) if pages == "huge" else torch.empty_like(groups)
        linears.append((copy.copy_(groups), n, k))
    return linears


def time_passes(kernels: dict, kind: str, weights: dict, threads: int, passes: int) -> dict:
    """Per (kernel, pages): the pass's seconds, every pass after a warm-up."""
    code = BLOCK_TYPES[kind]
    x, y = torch.randn(max(k for *_, k in weights[next(iter(weights))])), torch.empty(HEAD[0])
    seconds: dict[tuple[str, str], list[float]] = {}
    for index in range(passes + 1):
        for name, lib in kernels.items():
            kernel = lib.gguf_linear_int8
            for pages, linears in weights.items():
                start = time.perf_counter()
                for groups, n, k in linears:
                    kernel(
                        code,
                        x.data_ptr(),
                        1,
                        k,
                        groups.data_ptr(),
                        n,
                        groups.shape[1],
                        None,
                        y.data_ptr(),
                        threads,
                    )
                if index:
                    seconds.setdefault((name, pages), []).append(time.perf_counter() - start)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default=",".join(TYPES))
    parser.add_argument("--pages", default="huge,4k")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--passes", type=int, default=10)
    parser.add_argument("--against", help="a git revision whose kernel to time beside")
    parser.add_argument("--quick", action="store_true", help="2 layers, 2 passes")
    args = parser.parse_args()
    layers, passes = (2, 2) if args.quick else (LAYERS, args.passes)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        kernels = {"this checkout": _typed(build.load("gguf_int8"))}
        if args.against:
            kernels[args.against] = kernel_at(args.against, Path(folder))
        for kind in args.types.split(","):
            weights = {pages: pass_weights(kind, pages, layers) for pages in args.pages.split(",")}
            total = sum(groups.numel() for groups, *_ in weights[next(iter(weights))])
            timed = time_passes(kernels, kind, weights, args.threads, passes)
            for (name, pages), seconds in timed.items():
                best, median = min(seconds), statistics.median(seconds)
                rows.append(
                    [
                        kind,
                        name,
                        pages,
                        f"{total / 1e6:.0f}",
                        f"{best * 1e3:.2f}",
                        f"{total / best / 1e9:.1f}",
                        f"{total / median / 1e9:.1f}",
                    ]
                )
            del weights
    header = ["type", "kernel", "pages", "MB", "best ms", "best GB/s", "median GB/s"]
    title = f"a 500M decode step's linears from memory, {args.threads} threads"
    print(markdown_table(title, header, rows))


if __name__ == "__main__":
    main()
