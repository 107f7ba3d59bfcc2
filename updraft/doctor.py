"""``updraft doctor``: is graph replay healthy on this model and machine?

It runs the same greedy prompts eagerly and with captured steps in sanitize mode (every
replay is also run eagerly on a copy of the KV cache), and prints how each step ran, the
largest replay-vs-eager differences in logits and KV writes, and whether the outputs
agree token for token. With a speculative model (or method) it runs the target eager or
graph crossed with the draft eager or graph, four runs, and prints the acceptance per
draft position of each: a healthy run shows the four rows agreeing. It exits non-zero
when something disagrees.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from updraft.engine.llm import LLM
from updraft.graph.sanitize import SanitizeReport
from updraft.sampling_params import SamplingParams

PROMPTS = [
    "def fibonacci(n):",
    "import os\n\n\ndef list_files(path):",
    "class Stack:\n    def __init__(self):",
    "for i in range(10):",
    "# Return the largest element of a list\ndef largest(items):",
    "with open(path) as f:",
]
SAY = functools.partial(print, flush=True)  # runs take seconds: show each line at once
# Different lengths, so requests leave at different steps and the batch shrinks
# through the buckets.
MAX_TOKENS = [48, 40, 32, 24, 16, 8]


@dataclass
class DoctorRun:
    name: str
    token_ids: list[list[int]]
    seconds: float
    step_modes: dict[str, int]
    reports: list[SanitizeReport]  # target's, then the draft's
    acceptance: list[int] | None = None  # accepted drafts per position


def run(name: str, model: str | None, engine_args: dict[str, Any]) -> DoctorRun:
    llm = LLM(model, **engine_args)
    llm.engine.graphs_ready(wait=True)  # every step replayed, not eager while they are made
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    start = time.perf_counter()
    outputs = llm.generate(PROMPTS, params)
    seconds = time.perf_counter() - start
    stats = llm.engine.stats()
    modes = {"target": stats.describe_steps()}
    if stats.draft_steps is not None:
        modes["draft"] = stats.describe_draft_steps()
    reports = [r for r in (stats.sanitize, stats.draft_sanitize) if r is not None]
    return DoctorRun(
        name,
        [output.outputs[0].token_ids for output in outputs],
        seconds,
        modes,
        reports,
        None if stats.speculative is None else list(stats.speculative.accepted),
    )


def doctor(
    model: str | None,
    engine_args: dict[str, Any],
    log: Callable[[str], None] = SAY,
) -> bool:
    """Run the checks, print a report through ``log``; True when healthy."""
    # Sanitize copies the whole KV cache every step: keep it small.
    engine_args = {**engine_args, "kv_cache_memory_gib": 0.05, "num_kv_blocks": None}
    speculative = bool(
        engine_args.get("speculative_model") or engine_args.get("speculative_method")
    )
    draft_has_graphs = speculative and engine_args.get("speculative_method") != "ngram"
    combos = [(True, True), (False, False)]
    if draft_has_graphs:
        combos = [(True, True), (True, False), (False, True), (False, False)]
    runs = []
    for number, (target_eager, draft_eager) in enumerate(combos, start=1):
        name = "target " + ("eager" if target_eager else "graph")
        if draft_has_graphs:
            name += ", draft " + ("eager" if draft_eager else "graph")
        # Each run loads the model (and captures graphs): say what is happening.
        log(f"run {number} of {len(combos)}: {name} ...")
        args = {
            **engine_args,
            "enforce_eager": target_eager,
            "speculative_enforce_eager": draft_eager,
            "sanitize": not (target_eager and draft_eager),
        }
        runs.append(run(name, model, args))

    healthy = True
    for r in runs:
        log(f"{r.name}: {r.seconds:.2f} s")
        for which, modes in r.step_modes.items():
            log(f"  {which} steps: {modes}")
        for which, report in zip(["target", "draft"], r.reports, strict=False):
            log(f"  {which} sanitize: {report.summary()}")
            for mismatch in report.mismatches[:5]:
                log(f"    {mismatch}")
            healthy &= report.healthy
        if r.acceptance is not None:
            counts = " ".join(str(n) for n in r.acceptance)
            log(f"  accepted drafts per position: [{counts}]")
    reference = runs[0]
    for r in runs[1:]:
        if r.token_ids != reference.token_ids:
            differ = sum(a != b for a, b in zip(r.token_ids, reference.token_ids, strict=True))
            log(f"{r.name}: {differ} of {len(PROMPTS)} outputs differ from {reference.name}")
            healthy = False
        if r.acceptance != reference.acceptance:
            log(f"{r.name}: acceptance differs from {reference.name}")
            healthy = False
    replayed = any("graph" in modes for r in runs for modes in r.step_modes.values())
    if not replayed:
        log("no step replayed a graph: check --capture-sizes")
        healthy = False
    log("greedy outputs: identical across runs" if healthy else "")
    log("healthy" if healthy else "UNHEALTHY")
    return healthy
