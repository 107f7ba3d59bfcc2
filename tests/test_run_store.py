"""Compiled runs kept as their kernel calls (``graph/run_store.py``): a later start loads
them without importing inductor, and a kept file that is not what a start writes is
never run: it is compiled again, or replayed op by op where it fails its check."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.test_compiled_runs import Layer, capture
from updraft.graph import compiled_runs, run_store
from updraft.graph.compile_cache import open_cache

ROOT = Path(__file__).resolve().parents[1]
# A width no other test compiles, so these tests alone write and spoil its files.
WIDTH = 13

LATER_START = f"""
import sys, torch
from tests.test_compiled_runs import Layer, capture
with torch.inference_mode():
    torch.manual_seed(0)
    model = Layer({WIDTH})
    graph, out = capture(model)
    model.inputs.copy_(torch.randn(3, {WIDTH}))
    graph.replay({{"factor": 1.5}})
    torch.testing.assert_close(out, model.reference(1.5)[0])
print(sorted(m for m in sys.modules if m.startswith(("torch._inductor", "torch._dynamo"))))
"""


@pytest.fixture
def kept(monkeypatch) -> list[Path]:
    """The files of Layer(WIDTH)'s runs, kept by a capture in this process; the process's
    compiled runs forgotten after, as by a new start."""
    folder = open_cache()
    if folder is None:
        pytest.skip("TORCHINDUCTOR_CACHE_DIR is set: compiled runs are inductor's alone")
    monkeypatch.setattr(compiled_runs, "_compiled", {})
    with torch.inference_mode():
        capture(Layer(WIDTH))
    files = [
        folder / run_store.FOLDER / run_store.run_name(*key) for key in compiled_runs._compiled
    ]
    assert files and all(file.is_file() for file in files)
    monkeypatch.setattr(compiled_runs, "_compiled", {})
    return files


def replays_correctly() -> None:
    with torch.inference_mode():
        torch.manual_seed(0)
        model = Layer(WIDTH)
        graph, out = capture(model)
        for factor in (1.5, -2.0):
            model.inputs.copy_(torch.randn(3, WIDTH))
            graph.replay({"factor": factor})
            torch.testing.assert_close(out, model.reference(factor)[0])


def test_a_later_start_runs_kept_runs_without_importing_inductor(kept):
    result = subprocess.run(
        [sys.executable, "-c", LATER_START], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout


@pytest.mark.parametrize(
    "spoil", ["not JSON", "an input past the run's", "a library outside the folder"]
)
def test_a_kept_file_unlike_what_a_start_writes_is_compiled_again(kept, spoil, caplog):
    file = kept[0]
    written = file.read_text()
    data = json.loads(written)
    if spoil == "not JSON":
        file.write_text(written[:-7])
    elif spoil == "an input past the run's":
        data["calls"][0][1][0] = ["input", data["inputs"]]
        file.write_text(json.dumps(data))
    else:
        data["calls"][0][0] = "../" * 8 + "usr/lib/libc.so"
        file.write_text(json.dumps(data))
    replays_correctly()
    assert "not loaded" in caplog.text and "compiled again" in caplog.text
    anew, before = json.loads(file.read_text()), json.loads(written)
    # Written anew: the same calls of the same arguments. A kernel compiled in another
    # process may name its sizes otherwise, and so be another library file of the folder.
    assert [args for _, args in anew["calls"]] == [args for _, args in before["calls"]]
    assert {k: v for k, v in anew.items() if k != "calls"} == {
        k: v for k, v in before.items() if k != "calls"
    }
    assert all((file.parents[1] / library).is_file() for library, _ in anew["calls"])


def test_a_kept_run_that_fails_its_check_replays_op_by_op(kept, monkeypatch, caplog):
    """Loop bounds of 0 make each kept kernel write nothing (and nothing out of
    bounds): the check finds its targets unwritten. Nothing compiles meanwhile."""
    from torch._inductor import compile_fx

    def refuse(*args, **kwargs):
        raise AssertionError("compiled instead of loaded")

    monkeypatch.setattr(compile_fx, "compile_fx", refuse)
    for file in kept:
        data = json.loads(file.read_text())
        for call in data["calls"]:
            call[1] = [["int", 0] if arg[0] == "int" else arg for arg in call[1]]
        file.write_text(json.dumps(data))
    replays_correctly()
    assert "failed their check (missed a target)" in caplog.text
    assert not any(file.exists() for file in kept)  # the next start compiles them
