"""The engine's shape is checked, not hoped for: package layers (import-linter), no
module reading another's private state, no draft state on a request, and the scheduler
as the only caller of the KV block manager."""

from __future__ import annotations

import dataclasses
import inspect
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from updraft import LLM, SamplingParams
from updraft.engine.kv_blocks import KVCacheManager
from updraft.request import Request

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def lint_imports(cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "lint-imports"), "--no-cache"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_package_keeps_its_layers():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 kept, 0 broken" in result.stdout


def test_an_upward_import_breaks_the_layering_contract(tmp_path):
    shutil.copytree(ROOT / "updraft", tmp_path / "updraft", ignore=shutil.ignore_patterns("assets"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    request = tmp_path / "updraft" / "request.py"
    request.write_text(request.read_text() + "\nimport updraft.engine.scheduler  # noqa\n")
    result = lint_imports(tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert result.returncode != 0
    assert "updraft.request -> updraft.engine.scheduler" in result.stdout


def test_no_module_reads_another_modules_private_attributes():
    """The server, CLI and doctor see the engine through ``Engine.stats()``: its
    scheduler, runner and proposer are private, and ruff's SLF001 says who reaches in."""
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--select", "SLF001", "updraft"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout


def test_a_request_holds_no_draft_state():
    names = {field.name for field in dataclasses.fields(Request)}
    assert not [name for name in names if "draft" in name], names


def test_only_the_scheduler_allocates_and_frees_kv_blocks(tiny_llama, monkeypatch):
    """A speculative run tight enough to preempt, with aborts: every call into the KV
    block manager comes from the scheduler."""
    callers: dict[str, set[str]] = {}
    for name in ("allocate", "free", "register_computed", "cached_prefix"):
        original = getattr(KVCacheManager, name)

        def wrapped(self, *args, _original=original, _name=name, **kwargs):
            caller = inspect.currentframe().f_back.f_globals["__name__"]
            callers.setdefault(_name, set()).add(caller)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(KVCacheManager, name, wrapped)
    llm = LLM(
        tiny_llama,
        speculative_model=str(tiny_llama),
        block_size=4,
        num_kv_blocks=24,
        max_num_batched_tokens=32,
    )
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (30, 9, 21, 14)]
    prompts = [[(7 * i + j) % 250 + 1 for j in range(5 + 3 * i)] for i in range(4)]
    engine = llm.engine
    ids = [engine.add_request(p, s) for p, s in zip(prompts, params, strict=True)]
    steps, preemptions = 0, 0
    while engine.has_unfinished:
        for output in engine.step():
            preemptions += output.metrics.num_preemptions if output.finished else 0
        steps += 1
        if steps == 4:
            engine.abort(ids[1])
    assert preemptions > 0, "the cache was not tight enough to preempt"
    stats = engine.stats()
    assert stats.speculative.num_draft_tokens > 0
    assert stats.kv_blocks_used == 0
    assert set(callers) == {"allocate", "free", "register_computed", "cached_prefix"}
    assert all(modules == {"updraft.engine.scheduler"} for modules in callers.values()), callers


@pytest.mark.parametrize("module", ["updraft.request", "updraft.sampling_params", "updraft.step"])
def test_leaf_modules_import_no_engine_code(module):
    code = f"import sys, {module}; print(sorted(m for m in sys.modules if 'updraft.' in m))"
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    for layer in ("engine", "runner", "speculative", "serve", "models"):
        assert f"'updraft.{layer}" not in loaded, loaded
