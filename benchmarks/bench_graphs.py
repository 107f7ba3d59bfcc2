"""Per-step decode time, captured graph replay vs eager, on the demo model and a random
~100M Qwen3-style model and a random 121M DeepSeek-V3-shape one (MLA, MoE), at decode
batches of 1, 8 and 32. Replay in the engine's
default mode (compiled runs, FULL graphs on the CPU), compiled PIECEWISE graphs (the
attention a task between compiled runs), and PIECEWISE op by op.

For each model and batch, requests with prompts of 64-160 tokens are prefilled, then
one decode step is timed over and over through ``Runner.execute`` (forward, sampling
and the KV write at the same slots), alternating the three modes so that the machine's
drift affects all alike. The table shows the median of each.

    .venv/bin/python -m benchmarks.bench_graphs [--quick] [--device cuda]
        [--model-dir DIR] [--deepseek-dir DIR]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.bench_deepseek import make_random_deepseek_v3
from benchmarks.common import make_random_qwen3, markdown_table
from updraft import LLM, SamplingParams
from updraft.demo import DEMO_MODEL_DIR
from updraft.runner.captured import CapturedSteps
from updraft.step.inputs import StepInputs

BATCHES = (1, 8, 32)


def decode_step(llm: LLM, batch: int, vocab: int, rng: random.Random) -> StepInputs:
    """Prefill ``batch`` requests and return the next step, in which all of them decode."""
    engine = llm.engine
    for _ in range(batch):
        prompt = [rng.randrange(1, vocab) for _ in range(rng.randint(64, 160))]
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1000))
    while any(r.num_output_tokens == 0 for r in engine._scheduler.requests.values()):
        engine.step()
    step = StepInputs.build(engine._scheduler.schedule(), engine.config.block_size)
    assert step.num_decodes == step.num_reqs == batch
    return step


def time_modes(llm: LLM, step: StepInputs, repeats: int) -> dict[str, float]:
    """Median seconds per step for the engine's own replay (compiled, FULL on the CPU),
    compiled PIECEWISE replay, op-by-op PIECEWISE replay and eager, measured in turn."""
    runner = llm.engine._runner
    compiled = runner.captured

    def piecewise(compile_runs: bool) -> CapturedSteps:
        return CapturedSteps(
            runner.model,
            runner.kv_caches,
            runner.block_size,
            compiled.max_blocks,
            compiled.sizes,
            runner.device,
            compile_runs=compile_runs,
        )

    modes = {
        "compiled": compiled,
        "compiled piecewise": piecewise(compile_runs=runner.device.type == "cpu"),
        "op by op": piecewise(compile_runs=False),
        "eager": None,
    }
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    for i in range(repeats + 2):
        for mode, captured in modes.items():
            runner.captured = captured
            start = time.perf_counter()
            runner.execute(step)
            if i >= 2:  # two warm-up rounds
                times[mode].append(time.perf_counter() - start)
    runner.captured = compiled
    assert runner.step_modes["graph"] == 3 * (repeats + 2), "the graph steps did not replay"
    return {mode: statistics.median(seconds) for mode, seconds in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats, for a smoke run")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model-dir", type=Path, default=None, help="reuse a saved 100M model")
    parser.add_argument(
        "--deepseek-dir", type=Path, default=None, help="reuse a saved 121M DeepSeek-V3 model"
    )
    args = parser.parse_args()
    big = args.model_dir or Path(tempfile.mkdtemp()) / "qwen3-100m"
    make_random_qwen3(big)
    deepseek = args.deepseek_dir or Path(tempfile.mkdtemp()) / "deepseek-v3-120m"
    make_random_deepseek_v3(deepseek)
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    rows = []
    models = (
        ("demo 5.5M", DEMO_MODEL_DIR, 4096),
        ("Qwen3 100M", big, 32000),
        ("DeepSeek-V3 121M", deepseek, 32000),
    )
    for name, model_dir, vocab in models:
        for batch in BATCHES:
            llm = LLM(
                model_dir,
                device=args.device,
                dtype=dtype,
                enforce_eager=False,
                compile_graphs=args.device == "cpu",
                capture_sizes=(batch,),
                kv_cache_memory_gib=0.5,
            )
            step = decode_step(llm, batch, vocab, random.Random(batch))
            repeats = 5 if args.quick else (40 if name.startswith("demo") else 12)
            ms = time_modes(llm, step, repeats)
            rows.append(
                [
                    name,
                    str(batch),
                    f"{ms['eager'] * 1e3:.2f}",
                    f"{ms['op by op'] * 1e3:.2f}",
                    f"{ms['compiled piecewise'] * 1e3:.2f}",
                    f"{ms['compiled'] * 1e3:.2f}",
                    f"{ms['eager'] / ms['compiled piecewise']:.2f}x",
                    f"{ms['eager'] / ms['compiled']:.2f}x",
                ]
            )
            del llm
    print(
        markdown_table(
            f"decode step time, graph replay vs eager, {args.device}, {dtype}",
            [
                "model",
                "batch",
                "eager ms/step",
                "replay op by op",
                "compiled piecewise",
                "compiled, default mode",
                "piecewise / eager",
                "default / eager",
            ],
            rows,
        )
    )
    if args.device == "cuda":
        print(f"\n{torch.cuda.get_device_name()}")


if __name__ == "__main__":
    main()
