"""Per-step decode time, captured graph replay vs eager, on the demo model and a random
~100M Qwen3-style model and a random 121M DeepSeek-V3-shape one (MLA, MoE), at decode
batches of 1, 8 and 32. Replay in the engine's
default mode (compiled runs, FULL graphs on the CPU), compiled PIECEWISE graphs (the
attention a task between compiled runs), and PIECEWISE op by op.

For each model and batch, one runner per mode over the same weights prefills the same
requests (prompts of 64-160 tokens) into its own KV cache; then each runner's decode
step is timed over and over through ``Runner.execute`` (forward, sampling and the KV
write at the same slots), alternating the modes so that the machine's drift affects
all alike. The table shows the median of each.

    .venv/bin/python -m benchmarks.bench_graphs [--quick] [--device cuda]
        [--model-dir DIR] [--deepseek-dir DIR]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks.bench_deepseek import make_random_deepseek_v3
from benchmarks.common import make_random_qwen3, markdown_table
from updraft.config import EngineConfig
from updraft.demo import DEMO_MODEL_DIR
from updraft.engine.kv_blocks import BlockPool, KVCacheManager
from updraft.engine.scheduler import Scheduler
from updraft.model_config import ModelConfig
from updraft.request import Request
from updraft.runner.runner import Runner, load_runner
from updraft.sampling_params import SamplingParams
from updraft.step.inputs import StepInputs

BATCHES = (1, 8, 32)
MAX_MODEL_LEN = 1024


def mode_runners(model_dir: Path, batch: int, device: str, dtype: str) -> dict[str, Runner]:
    """One runner per mode over the same loaded weights: the engine's default
    (compiled runs, FULL graphs on the CPU), compiled PIECEWISE replay, op-by-op
    PIECEWISE replay, and eager."""
    model_config = ModelConfig.from_dir(model_dir)
    config = EngineConfig(
        model=str(model_dir),
        device=device,
        dtype=dtype,
        compile_graphs=device == "cpu",
        capture_sizes=(batch,),
        kv_cache_memory_gib=0.5,
    )
    default = load_runner(model_config, config, MAX_MODEL_LEN)
    variants = {
        "compiled piecewise": replace(config, graph_mode="piecewise"),
        "op by op": replace(config, graph_mode="piecewise", compile_graphs=False),
        "eager": replace(config, enforce_eager=True),
    }
    runners = {"compiled": default}
    for mode, variant in variants.items():
        runners[mode] = Runner(
            default.model, model_config, variant, MAX_MODEL_LEN, dtype=default.dtype
        )
    return runners


def decode_step(runner: Runner, batch: int, vocab: int, seed: int) -> StepInputs:
    """Prefill ``batch`` requests into the runner's cache and return the next step, in
    which all of them decode (the same step for every runner given the same seed)."""
    rng = random.Random(seed)
    pool = BlockPool(runner.num_blocks, runner.positions_per_block, False)
    scheduler = Scheduler(KVCacheManager(pool), batch, 4096, MAX_MODEL_LEN)
    for index in range(batch):
        prompt = [rng.randrange(1, vocab) for _ in range(rng.randint(64, 160))]
        scheduler.add(Request(str(index), None, prompt, SamplingParams(temperature=0)))
    while any(r.num_output_tokens == 0 for r in scheduler.requests.values()):
        plan = scheduler.schedule()
        scheduler.update(plan, runner.execute(StepInputs.build(plan, pool.block_size)))
    step = StepInputs.build(scheduler.schedule(), pool.block_size)
    assert step.forward.num_decodes == step.num_reqs == batch
    return step


def time_modes(
    runners: dict[str, Runner], steps: dict[str, StepInputs], repeats: int
) -> dict[str, float]:
    """Median seconds per step of each mode's runner, measured in turn."""
    times: dict[str, list[float]] = {mode: [] for mode in runners}
    for i in range(repeats + 2):
        for mode, runner in runners.items():
            start = time.perf_counter()
            runner.execute(steps[mode])
            if i >= 2:  # two warm-up rounds
                times[mode].append(time.perf_counter() - start)
    for mode, runner in runners.items():
        replayed = runner.step_modes["graph"] >= repeats + 2
        assert replayed == (mode != "eager"), (mode, runner.step_modes)
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
            runners = mode_runners(model_dir, batch, args.device, dtype)
            steps = {mode: decode_step(r, batch, vocab, batch) for mode, r in runners.items()}
            repeats = 5 if args.quick else (40 if name.startswith("demo") else 12)
            ms = time_modes(runners, steps, repeats)
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
            del runners, steps
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
