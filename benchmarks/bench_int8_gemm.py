"""One int8-activation linear at a time: ``gguf_gemm_int8`` over a prefill's rows (256 by
default) for each GGUF block type the prefill aims depend on, on the 500M Qwen3-shape
model's weight shapes (hidden 1536, intermediate 4096: q, o, k/v, gate/up, down),
as integer multiply-adds per second (rows x n x k / s), and ``gguf_linear_int8`` on one
row (a decode step) as the weight's bytes per second (they sit in the cache: this is
the kernel's speed, not the memory's). Random valid blocks (their values do not change
the time).

``--against REV``: the same calls on the kernel as it was at git revision REV too
(``gguf_int8.c`` and its headers, built with the same flags), the two alternated call
by call, so that a machine others share slows both alike; each time is the best of
``--repeats`` rounds.

    .venv/bin/python -m benchmarks.bench_int8_gemm [--against main] [--threads 1] \\
        [--types Q4_K,Q6_K] [--quick]

``--prefill FILE`` (with ``--against``): instead, a whole cold prefill of a 256-token
prompt of a GGUF file (eager steps, a fresh prompt each time), the engine's
``gguf_gemm_int8`` switched between the two kernels prompt by prompt, as prompt
tokens/s (best of ``--repeats``); everything but the quantized linears is the same
code in both.
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import markdown_table
from tests.test_gguf import random_blocks
from updraft import LLM, SamplingParams
from updraft.kernels import build, gguf_ops
from updraft.kernels.gguf_ops import BLOCK_TYPES, gguf_group

# (n, k) of the 500M model's linears: q and o, k and v (4 KV heads of 128), gate/up, down
SHAPES = ((2048, 1536), (1536, 2048), (512, 1536), (4096, 1536), (1536, 4096))
TYPES = ("Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K")
KERNELS = Path(build.__file__).parent


def _typed(lib: ctypes.CDLL) -> ctypes.CDLL:
    arguments = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    arguments += [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    for name in ("gguf_gemm_int8", "gguf_linear_int8"):
        getattr(lib, name).restype = None
        getattr(lib, name).argtypes = [*arguments, ctypes.c_void_p, ctypes.c_int]
    return lib


def kernel_at(revision: str, folder: Path) -> ctypes.CDLL:
    """gguf_int8.c and the headers beside it as they were at ``revision``, built."""
    root = subprocess.run(
        ["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True
    ).stdout.strip()
    listed = subprocess.run(
        ["git", "ls-tree", "--name-only", revision, "updraft/kernels/"],
        capture_output=True,
        text=True,
        check=True,
        cwd=root,
    ).stdout.split()
    for path in listed:
        if path.endswith((".h", "gguf_int8.c")):
            text = subprocess.run(
                ["git", "show", f"{revision}:{path}"], capture_output=True, check=True, cwd=root
            ).stdout
            (folder / Path(path).name).write_bytes(text)
    compiler = build._compiler()  # noqa: SLF001
    objects, library = folder / "gguf_int8.o", folder / "gguf_int8.so"
    subprocess.run(
        [compiler, *build.COMPILE, str(folder / "gguf_int8.c"), "-o", str(objects)], check=True
    )
    subprocess.run(
        [compiler, *build.LINK, str(objects), "-o", str(library), *build.LIBRARIES], check=True
    )
    return _typed(ctypes.CDLL(str(library)))


def time_kernels(kernels: dict, kind: str, shapes, rows: int, threads: int, repeats: int) -> dict:
    """Per kernel: (prefill G multiply-adds/s, decode GB/s) over ``shapes``."""
    code = BLOCK_TYPES[kind]
    seconds = {name: [0.0, 0.0] for name in kernels}
    macs = weight_bytes = 0
    for n, k in shapes:
        blocks = random_blocks(kind, n, k, np.random.default_rng(n + k))
        groups = gguf_group(torch.from_numpy(blocks), code, k)
        x, y = torch.randn(rows, k), torch.empty(rows, n)
        calls = [("gguf_gemm_int8", rows, 2), ("gguf_linear_int8", 1, 50)]
        for which, (function, m, times) in enumerate(calls):
            best = dict.fromkeys(kernels, float("inf"))
            for _ in range(repeats + 1):  # the first round warms up
                for name, lib in kernels.items():
                    kernel = getattr(lib, function)
                    arguments = (code, x.data_ptr(), m, k, groups.data_ptr(), n, groups.shape[1])
                    start = time.perf_counter()
                    for _ in range(times):
                        kernel(*arguments, None, y.data_ptr(), threads)
                    best[name] = min(best[name], (time.perf_counter() - start) / times)
            for name in kernels:
                seconds[name][which] += best[name]
        macs += rows * n * k
        weight_bytes += blocks.nbytes
    return {
        name: (macs / prefill / 1e9, weight_bytes / decode / 1e9)
        for name, (prefill, decode) in seconds.items()
    }


def time_prefill(path: Path, kernels: dict, threads: int, repeats: int) -> dict:
    """Per kernel: prompt tokens/s of a cold 256-token prefill of the GGUF file at
    ``path``, the engine's gguf_gemm_int8 swapped to each kernel in turn."""
    torch.set_num_threads(threads)
    llm = LLM(str(path), enforce_eager=True)  # eager: each call looks the kernel up
    engine_kernels = gguf_ops._int8_library()  # noqa: SLF001 - the kernel a step calls
    original = engine_kernels.gguf_gemm_int8
    vocab = llm.engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    rng = np.random.default_rng(256)
    best = dict.fromkeys(kernels, float("inf"))
    for _ in range(repeats + 1):  # the first round warms up
        for name, lib in kernels.items():
            kernel = lib.gguf_gemm_int8
            kernel.argtypes, kernel.restype = original.argtypes, original.restype
            engine_kernels.gguf_gemm_int8 = kernel
            prompt = rng.integers(0, vocab, 256).tolist()
            start = time.perf_counter()
            llm.generate([prompt], [params])
            best[name] = min(best[name], time.perf_counter() - start)
    engine_kernels.gguf_gemm_int8 = original
    llm.engine.close()
    return {name: 256 / seconds for name, seconds in best.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default=",".join(TYPES))
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--against", help="a git revision whose kernel to time beside")
    parser.add_argument("--quick", action="store_true", help="one small shape, 1 repeat")
    parser.add_argument("--prefill", type=Path, help="a GGUF file to prefill 256 tokens of")
    args = parser.parse_args()
    shapes = ((256, 512),) if args.quick else SHAPES
    repeats = 1 if args.quick else args.repeats
    with tempfile.TemporaryDirectory() as folder:
        kernels = {"this checkout": _typed(build.load("gguf_int8"))}
        if args.against:
            kernels[args.against] = kernel_at(args.against, Path(folder))
        if args.prefill:
            speeds = time_prefill(args.prefill, kernels, args.threads, args.repeats)
            rows = [[args.prefill.name, name, f"{speed:.1f}"] for name, speed in speeds.items()]
            title = f"cold prefill of 256 tokens, {args.threads} threads"
            print(markdown_table(title, ["file", "kernel", "prompt tokens/s"], rows))
            return
        table = []
        for kind in args.types.split(","):
            timed = time_kernels(kernels, kind, shapes, args.rows, args.threads, repeats)
            for name, (gmacs, gbytes) in timed.items():
                table.append([kind, name, f"{gmacs:.0f}", f"{gbytes:.1f}"])
    header = ["type", "kernel", f"prefill {args.rows} rows, G MAC/s", "decode 1 row, GB/s"]
    title = f"int8 linears one at a time, {args.threads} threads"
    print(markdown_table(title, header, table))


if __name__ == "__main__":
    main()
