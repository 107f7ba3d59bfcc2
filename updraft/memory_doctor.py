"""``updraft doctor --memory``: where the engine's resident memory goes.

Starts an engine with the given settings, recording each phase of its start (weights,
KV cache, captures), runs one greedy request, and prints the resident set cut into
its parts (``engine/memory_report.py``) with the peak and the phase it came in. The
caller measures the interpreter and torch's import first (``ImportBaseline``), before
anything imports torch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from updraft.engine.llm import LLM
from updraft.engine.memory_report import MemoryReport, build_report, compiler_stack_cost
from updraft.resident import ImportBaseline, recording_phases
from updraft.sampling_params import SamplingParams

SAY = functools.partial(print, flush=True)
PROMPT_TOKENS = 32
NEW_TOKENS = 64


def measure_memory(
    model: str | None,
    engine_args: dict[str, Any],
    baseline: ImportBaseline | None,
    prompt_tokens: int = PROMPT_TOKENS,
    new_tokens: int = NEW_TOKENS,
) -> MemoryReport:
    """An engine's memory after its start and one request of ``prompt_tokens`` tokens
    generating ``new_tokens``."""
    with recording_phases() as log:
        llm = LLM(model, **engine_args)
        log.mark("engine ready")
        vocab = llm.engine.model_config.vocab_size
        prompt = [(7 * i + 3) % vocab for i in range(prompt_tokens)]
        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        llm.generate([prompt], params)
        log.mark(f"one request ({prompt_tokens} + {new_tokens} tokens)")
        owned = llm.engine.memory()
    return build_report(owned, baseline, log.phases, log.start_rss, compiler_stack_cost())


def memory_doctor(
    model: str | None,
    engine_args: dict[str, Any],
    baseline: ImportBaseline | None,
    log: Callable[[str], None] = SAY,
) -> bool:
    """Print the memory report through ``log``; True (it judges nothing)."""
    log("starting the engine, recording its memory ...")
    report = measure_memory(model, engine_args, baseline)
    for line in report.lines():
        log(line)
    return True
