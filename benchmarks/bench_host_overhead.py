"""Host time per engine step: everything outside the model forward (scheduling, building
the step's inputs, sampling bookkeeping, detokenizing, building outputs), on the demo
model, eager, float32.

1. Decode steps at batch 1 and 32 (token-id prompts of 16-48 tokens, greedy, 128 new
   tokens each), and at batch 32 with every request carrying the most stop strings a
   request may (32 of 256 characters, none matching): per step, total wall time of
   ``Engine.step()`` and the time spent in the model's forward and logits (the
   ``forward`` phase of ``Engine.stats().phase_seconds``); host time is the difference.
   Medians over every decode step of the run, best of ``--rounds``.
2. One request generating 4,096 tokens: output tokens/s and host time per step over the
   first and the last 512 tokens. A cost that grows with the output (copying the token
   list or the text at every step) shows up as more host time in the last window; the
   step itself slows down because attention reads a 4k-token context there.

    .venv/bin/python -m benchmarks.bench_host_overhead [--quick]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import markdown_table
from updraft import LLM, SamplingParams
from updraft.demo import DEMO_MODEL_DIR
from updraft.sampling_params import MAX_STOP_STRING_LENGTH, MAX_STOP_STRINGS

BATCHES = (1, 32)
LONG_OUTPUT = 4096
WINDOW = 512


def long_context_demo() -> Path:
    """The demo checkpoint with its context raised from 2,048 to 4,160 positions, so one
    request can generate 4,096 tokens (its RoPE extends to them; the text past 2k is
    not what it was trained for, which does not matter for timing)."""
    directory = Path(tempfile.mkdtemp()) / "demo-4k"
    shutil.copytree(DEMO_MODEL_DIR, directory)
    config = json.loads((directory / "config.json").read_text())
    config["max_position_embeddings"] = LONG_OUTPUT + 64
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def timed_steps(llm: LLM) -> list[tuple[float, float, int]]:
    """(total seconds, forward seconds, new tokens) of every step until all finish."""
    engine = llm.engine
    steps = []
    while engine.has_unfinished:
        forward = engine.stats().phase_seconds.get("forward", 0.0)
        start = time.perf_counter()
        outputs = engine.step()
        total = time.perf_counter() - start
        forward = engine.stats().phase_seconds["forward"] - forward
        steps.append((total, forward, sum(len(o.outputs[0].delta_token_ids) for o in outputs)))
    return steps


# The most stop strings a request may carry, each as long as allowed, none ever matching.
MOST_STOPS = [chr(0x4E00 + i) * MAX_STOP_STRING_LENGTH for i in range(MAX_STOP_STRINGS)]


def decode_host_time(
    llm: LLM, batch: int, seed: int, stop: list[str] | None = None
) -> tuple[float, float]:
    """Median (total, host) milliseconds of the decode steps of one batch."""
    rng = random.Random(seed)
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True, stop=stop or [])
    for _ in range(batch):
        prompt = [rng.randrange(1, 4096) for _ in range(rng.randint(16, 48))]
        llm.engine.add_request(prompt, params)
    steps = timed_steps(llm)
    # The first step prefills every prompt; the rest decode.
    decode = steps[1:]
    total = statistics.median(t for t, _, _ in decode)
    host = statistics.median(t - f for t, f, _ in decode)
    return total * 1e3, host * 1e3


def long_output(llm: LLM) -> list[tuple[float, float, float]]:
    """(tokens/s, median step ms, median host ms) over the first and last windows."""
    params = SamplingParams(temperature=0, max_tokens=LONG_OUTPUT, ignore_eos=True)
    llm.engine.add_request(list(range(1, 33)), params)
    steps = timed_steps(llm)[1:]  # one token per decode step
    return [
        (
            len(window) / sum(t for t, _, _ in window),
            statistics.median(t for t, _, _ in window) * 1e3,
            statistics.median(t - f for t, f, _ in window) * 1e3,
        )
        for window in (steps[:WINDOW], steps[-WINDOW:])
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one round, for a smoke run")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rounds = 1 if args.quick else args.rounds
    llm = LLM(long_context_demo(), dtype="float32", enable_prefix_caching=False)
    rows = []
    for batch in BATCHES:
        runs = [decode_host_time(llm, batch, seed) for seed in range(rounds)]
        best = min(runs, key=lambda r: r[1])
        spread = f"{min(h for _, h in runs):.2f}-{max(h for _, h in runs):.2f}"
        rows.append([f"decode, batch {batch}", f"{best[0]:.2f}", f"{best[1]:.2f}", spread, ""])
    runs = [decode_host_time(llm, 32, seed, MOST_STOPS) for seed in range(rounds)]
    best = min(runs, key=lambda r: r[1])
    spread = f"{min(h for _, h in runs):.2f}-{max(h for _, h in runs):.2f}"
    label = f"decode, batch 32, each with {len(MOST_STOPS)} stop strings"
    rows.append([label, f"{best[0]:.2f}", f"{best[1]:.2f}", spread, ""])
    runs = [long_output(llm) for _ in range(rounds)]
    best = max(runs, key=lambda windows: windows[1][0])
    for label, (rate, step, host) in zip(("first", "last"), best, strict=True):
        rows.append(
            [
                f"{LONG_OUTPUT:,}-token output, {label} {WINDOW} tokens",
                f"{step:.2f}",
                f"{host:.2f}",
                "",
                f"{rate:.1f}",
            ]
        )
    print(
        markdown_table(
            "host time per engine step, demo model, eager, float32",
            ["measure", "step ms (median)", "host ms (median)", "host ms spread", "tokens/s"],
            rows,
        )
    )


if __name__ == "__main__":
    main()
