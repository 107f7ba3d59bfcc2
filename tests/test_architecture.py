"""The engine's shape is checked, not hoped for: package layers (import-linter), no
module reading another's private state, no draft state on a request, the scheduler as
the only caller of the KV block manager, one attention loop, the context split on the
metadata alone, the graph contract as a type, and one step driver."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import re
import shutil
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from tests.helpers import greedy
from updraft import LLM
from updraft.attention.metadata import AttentionMetadata, ContextSplit
from updraft.engine.kv_blocks import KVCacheManager
from updraft.request import Request
from updraft.step.inputs import (
    ALL_GRAPH_INPUTS,
    GRAPH_INPUTS,
    HEAD_GRAPH_INPUTS,
    ForwardInputs,
    SamplingInputs,
    StepInputs,
    graph_inputs,
)

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
    """The server, CLI and doctor, the tests and the benchmarks see the engine through
    ``Engine.stats()`` and the runner probe: its scheduler, runner and proposer are
    private, and ruff's SLF001 says who reaches in."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "ruff",
            "check",
            "--select",
            "SLF001",
            "updraft",
            "tests",
            "benchmarks",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout


def test_a_request_holds_no_draft_state():
    names = {field.name for field in dataclasses.fields(Request)}
    assert not [name for name in names if "draft" in name], names


def test_a_request_holds_no_grammar_state():
    """A constrained request's grammar lives in the engine's Grammars alone."""
    names = {field.name for field in dataclasses.fields(Request)}
    assert not [n for n in names if any(w in n for w in ("grammar", "matcher", "structured"))]


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
    params = [greedy(n) for n in (30, 9, 21, 14)]
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


# -- the shape of attention, the graph contract and the step driver ---------------------


def sources(folder: str) -> dict[str, str]:
    """The text of every module of the package under ``folder``, by its path there."""
    root = ROOT / "updraft" / folder
    return {str(path.relative_to(root)): path.read_text() for path in sorted(root.rglob("*.py"))}


def test_one_loop_walks_a_steps_attention_groups():
    """Every attention kind reads its cache through one loop over ``metadata.shapes``
    (``attention/loop.py``, found by an AST scan): a new kind is a cache reader, not a
    new loop; and decode context parallelism names no attention kind."""
    loops = [
        f"{name}:{node.iter.lineno}"
        for name, text in sources("attention").items()
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.For | ast.comprehension)
        and any(getattr(part, "attr", None) == "shapes" for part in ast.walk(node.iter))
    ]
    assert len(loops) == 1 and loops[0].startswith("loop.py"), loops
    text = sources("attention")["context_parallel.py"].lower()
    assert not [word for word in ("latent", "kv_lora_rank", "index_") if word in text]


def test_no_model_module_sets_a_context_split_and_the_metadata_is_frozen():
    """How context is split over ranks reaches attention on the metadata alone: no
    module under ``models/`` assigns (or ``setattr``s) such an attribute, and no field
    of the metadata can be assigned once it is built."""
    split = re.compile(r"\.\w*context\w*\s*=[^=]|setattr\([^)]*context")
    assert not [name for name, text in sources("models").items() if split.search(text)]
    step = StepInputs.from_queries([], positions_per_block=4).forward
    metadata = AttentionMetadata.from_step(step, 4, "cpu")
    for field, value in (("slot_mapping", None), ("context", ContextSplit())):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(metadata, field, value)


def test_the_graph_contract_is_a_type():
    """What a forward reads is ``ForwardInputs``: exactly the declared graph inputs, a
    draft head's hidden states, a LongRoPE model's rotary rows, a hybrid model's state
    slots and a windowed pool's slots and block table; attention metadata is built from
    it alone."""
    fields = {field.name for field in dataclasses.fields(ForwardInputs)}
    assert fields == {spec.name for spec in ALL_GRAPH_INPUTS}
    window = {"window_slot_mapping", "window_block_table"}
    assert {spec.name for spec in HEAD_GRAPH_INPUTS} | {"rotary_rows", "state_slots", *window} == (
        fields
    )
    extra = {"hidden_states", "rotary_rows", "state_slots", *window}
    assert {spec.name for spec in GRAPH_INPUTS} | extra == fields
    every = graph_inputs(head=True, rotary=True, state=True, window=True)
    assert {spec.name for spec in every} == fields
    for build in (AttentionMetadata.from_step, AttentionMetadata.bind):
        assert typing.get_type_hints(build)["step"] is ForwardInputs
    assert not {field.name for field in dataclasses.fields(SamplingInputs)} & fields


def test_one_step_driver_and_an_engine_that_asks_no_proposer_by_getattr():
    """Every model that runs a step (target, draft model, draft head, the greedy draft
    loop) captures and replays through the one runner type; the engine reads what it
    shows of a proposer through the proposer's interface alone."""
    names = r"\b(UpdatableGraph|RecordedGraph|CudaGraph|CapturedSteps)\b"
    graphs = re.compile(rf"^\s*(from|import) .*{names}|{names}\(", re.MULTILINE)
    users = {name for name, text in sources(".").items() if graphs.search(text)}
    assert {name for name in users if not name.startswith("graph/")} == {
        "runner/captured.py",
        "runner/runner.py",
    }
    assert not [n for n, text in sources("engine").items() if re.search(r"\b(get|has)attr\(", text)]
