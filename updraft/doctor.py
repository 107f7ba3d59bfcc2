"""``updraft doctor``: is graph replay healthy on this model and machine?

It runs the same prompts twice, eagerly and with captured decode steps in sanitize mode
(every replay is also run eagerly on a copy of the KV cache), and prints how each step
ran, the largest replay-vs-eager differences in logits and KV writes, and whether the
greedy outputs agree token for token. It exits non-zero when they do not.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from updraft.engine.llm import LLM
from updraft.sampling import SamplingParams

PROMPTS = [
    "def fibonacci(n):",
    "import os\n\n\ndef list_files(path):",
    "class Stack:\n    def __init__(self):",
    "for i in range(10):",
    "# Return the largest element of a list\ndef largest(items):",
    "with open(path) as f:",
]
# Different lengths, so requests leave at different steps and the batch shrinks
# through the buckets.
MAX_TOKENS = [48, 40, 32, 24, 16, 8]


@dataclass
class DoctorRun:
    name: str
    token_ids: list[list[int]]
    step_modes: dict[str, int]
    seconds: float
    sanitize: Any = None


def run(name: str, model: str | None, engine_args: dict[str, Any]) -> DoctorRun:
    llm = LLM(model, **engine_args)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    start = time.perf_counter()
    outputs = llm.generate(PROMPTS, params)
    runner = llm.engine.runner
    return DoctorRun(
        name,
        [output.outputs[0].token_ids for output in outputs],
        dict(runner.step_modes),
        time.perf_counter() - start,
        runner.sanitize_report,
    )


def doctor(model: str | None, engine_args: dict[str, Any], log=print) -> bool:
    """Run the checks, print a report through ``log``; True when healthy."""
    # Sanitize copies the whole KV cache every step: keep it small.
    engine_args = {**engine_args, "kv_cache_memory_gib": 0.05, "num_kv_blocks": None}
    runs = [
        run("eager", model, {**engine_args, "enforce_eager": True}),
        run("graph", model, {**engine_args, "enforce_eager": False, "sanitize": True}),
    ]
    log(f"{'run':<8}{'seconds':>9}  steps")
    for r in runs:
        modes = ", ".join(f"{n} {mode}" for mode, n in sorted(r.step_modes.items()))
        log(f"{r.name:<8}{r.seconds:>9.2f}  {modes}")
    eager, graph = runs
    report = graph.sanitize
    log(f"sanitize: {report.summary()}")
    for mismatch in report.mismatches[:10]:
        log(f"  {mismatch}")
    same = eager.token_ids == graph.token_ids
    differing = sum(a != b for a, b in zip(eager.token_ids, graph.token_ids, strict=True))
    log(
        "greedy outputs: identical"
        if same
        else f"greedy outputs: {differing} of {len(PROMPTS)} differ between eager and graph"
    )
    replayed = graph.step_modes.get("graph", 0) > 0
    if not replayed:
        log("no step replayed a graph: check --capture-sizes")
    healthy = same and report.healthy and replayed
    log("healthy" if healthy else "UNHEALTHY")
    return healthy
