"""Prefill steps, captured mixed-bucket graph vs eager, on the 100M Qwen3-shape float32
checkpoint: one fresh prompt of n tokens per step (max_tokens 1, prefix caching off),
so each step is one prefill chunk. Two engines over the same weights, one replaying the
default mixed buckets (``capture_tokens`` 16-256: a step is padded to the next bucket,
its matrix products over its own tokens only), one running every prefill eagerly;
the lengths alternate between them so that the machine's drift hits both alike. The
table shows each length's best of ``--repeats`` steps (whole ``generate`` calls) and the
graph's time as a fraction of eager's; a 512-token step fits no default bucket and
shows the two alike.

    .venv/bin/python -m benchmarks.bench_prefill_steps [--repeats 8] [--model-dir DIR]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

from benchmarks.common import make_random_qwen3, markdown_table
from updraft import LLM, SamplingParams

LENGTHS = (12, 20, 40, 70, 100, 150, 200, 256, 512)
VOCAB = 32000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--model-dir", type=Path, default=None, help="reuse a saved 100M model")
    args = parser.parse_args()
    model = make_random_qwen3(args.model_dir or Path(tempfile.mkdtemp()) / "qwen3-100m")
    common = dict(dtype="float32", max_num_batched_tokens=512, enable_prefix_caching=False)
    engines = {
        "graph": LLM(str(model), **common),
        "eager": LLM(str(model), capture_tokens=(), **common),
    }
    params = SamplingParams(max_tokens=1, temperature=0)
    rng = random.Random(0)
    best = {(mode, n): float("inf") for mode in engines for n in LENGTHS}
    for _ in range(args.repeats):
        for n in LENGTHS:
            for mode, llm in engines.items():
                prompt = [rng.randrange(VOCAB) for _ in range(n)]
                start = time.perf_counter()
                llm.generate([prompt], params)
                best[mode, n] = min(best[mode, n], time.perf_counter() - start)
    for mode, llm in engines.items():
        print(f"{mode}: steps {llm.engine.stats().describe_steps()}")
    rows = [
        [
            str(n),
            f"{best['eager', n] * 1e3:.1f}",
            f"{best['graph', n] * 1e3:.1f}",
            f"{best['graph', n] / best['eager', n]:.2f}",
        ]
        for n in LENGTHS
    ]
    print(
        markdown_table(
            f"one-prompt prefill steps, Qwen3 100M float32, best of {args.repeats}",
            ["prompt tokens", "eager ms", "mixed-bucket graph ms", "graph / eager"],
            rows,
        )
    )


if __name__ == "__main__":
    main()
