"""The CPU thread budget leaves other processes the cores they keep busy and takes
them back when they go quiet; the threads beside the steps run below their priority."""

from __future__ import annotations

import os
import sys
import threading

import pytest
import torch

from updraft.engine.grammar_compiler import GrammarCompiler
from updraft.runner import threads
from updraft.runner.side_threads import LOWER_BY, SIDE_THREADS
from updraft.runner.threads import ThreadBudget
from updraft.structured_outputs import StructuredOutputsParams


class FakeMachine:
    """/proc readings: ``busy`` ticks of the whole machine, ``own`` of this process;
    100 ticks per second, and a clock the test moves."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now = 0.0
        self.busy = 0
        self.own = 0
        monkeypatch.setattr(threads, "_machine_busy_ticks", lambda: self.busy)
        monkeypatch.setattr(threads, "_own_ticks", lambda: self.own)
        monkeypatch.setattr(threads.time, "monotonic", lambda: self.now)
        monkeypatch.setattr(threads.os, "sysconf", lambda name: 100)
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)

    def run(self, seconds: float, own_cores: float, other_cores: float) -> None:
        self.now += seconds
        self.own += round(100 * seconds * own_cores)
        self.busy += round(100 * seconds * (own_cores + other_cores))


@pytest.fixture
def machine(monkeypatch):
    """A 4-core machine whose thread-count changes are recorded, not applied."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    counts = []
    monkeypatch.setattr(torch, "set_num_threads", counts.append)
    fake = FakeMachine(monkeypatch)
    fake.counts = counts
    return fake


def test_a_busy_neighbour_takes_a_core_and_gives_it_back(machine):
    budget = ThreadBudget()
    assert budget.adjust() == 4
    machine.run(1.0, own_cores=4, other_cores=0.0)
    assert budget.adjust() == 4 and machine.counts == []
    machine.run(1.0, own_cores=3, other_cores=1.0)  # one busy loop
    assert budget.adjust() == 3 and machine.counts == [3]
    machine.run(0.1, own_cores=3, other_cores=2.0)
    assert budget.adjust() == 3  # not re-read within half a second
    machine.run(1.0, own_cores=2, other_cores=2.1)
    assert budget.adjust() == 2
    machine.run(1.0, own_cores=2, other_cores=0.2)  # light work is not a core
    assert budget.adjust() == 4 and machine.counts == [3, 2, 4]


def test_never_below_one_thread(machine):
    budget = ThreadBudget()
    machine.run(1.0, own_cores=1, other_cores=7.0)
    assert budget.adjust() == 1


def test_a_fixed_thread_count_or_disabled_budget_is_left_alone(machine, monkeypatch):
    off = ThreadBudget(enabled=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    fixed = ThreadBudget()
    machine.run(1.0, own_cores=1, other_cores=3.0)
    assert off.adjust() == 4 and fixed.adjust() == 4 and machine.counts == []


def test_engine_stats_report_the_thread_count(tiny_llama):
    from updraft import LLM

    llm = LLM(tiny_llama, num_kv_blocks=16)
    assert llm.engine.stats().threads == torch.get_num_threads()


def _nice_of_this_thread() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own nice is Linux's")
def test_grammar_threads_run_below_the_steps_priority(monkeypatch, tmp_path):
    """A grammar compile runs 10 nice values below the thread that asked for it, so a
    flood of costly grammars yields the cores to the steps, and its CPU time counts as
    another process's; the caller keeps its own priority."""

    def nice_and_counted(self, spec):
        return _nice_of_this_thread(), threading.get_native_id() in SIDE_THREADS

    monkeypatch.setattr(GrammarCompiler, "matcher", nice_and_counted)
    compiler = GrammarCompiler(tmp_path / "tokenizer.json", 32, (0,))
    try:
        before = _nice_of_this_thread()
        spec = StructuredOutputsParams(regex="[0-9]+")
        nice, counted = compiler.submit(spec).result(timeout=10)
    finally:
        compiler.close()
    assert nice == min(19, os.getpriority(os.PRIO_PROCESS, 0) + LOWER_BY) and counted
    assert _nice_of_this_thread() == before
