"""Start-up: an engine answers with eager steps at once, makes its graphs in a thread
(``runner/capture_worker.py``) and swaps each in between two steps; inductor's compiled
runs are kept in a checked folder of the user's cache (``graph/compile_cache.py``)."""

from __future__ import annotations

import json
import threading

import pytest

from tests.helpers import greedy, token_ids
from updraft import LLM
from updraft.config import EngineConfig
from updraft.graph import compile_cache
from updraft.runner.capture_worker import CaptureWorker

PROMPT = list(range(10, 27))
STEPS = 24
# One decode bucket, prefills eager: a few distinct runs for inductor, the same as
# test_graph_engine.py's batch-1 bucket compiles (its shapes: inductor's cache has them).
ARGS = dict(block_size=4, num_kv_blocks=128, capture_sizes=(1,), capture_tokens=())


def test_a_greedy_generation_spanning_the_swap_equals_eager_and_compiled(tiny_llama, monkeypatch):
    """The first steps run before any graph is ready, the next replay the recorded
    bucket op by op, and from the step after the swap its compiled runs: every token
    equals a fully eager engine's and a fully compiled one's."""
    eager = token_ids(LLM(tiny_llama, enforce_eager=True, **ARGS).generate([PROMPT], greedy(STEPS)))
    compiled = LLM(tiny_llama, compile_graphs=True, graphs_in_background=False, **ARGS)
    assert token_ids(compiled.generate([PROMPT], greedy(STEPS))) == eager
    assert compiled.engine.stats().steps["graph"] == STEPS - 1

    captured, compiling = threading.Event(), threading.Event()
    compile_all = CaptureWorker.compile_all

    def when_told(worker, graphs):
        captured.set()
        compiling.wait()  # the test says when
        compile_all(worker, graphs)

    monkeypatch.setattr(CaptureWorker, "compile_all", when_told)
    llm = LLM(tiny_llama, compile_graphs=True, graphs_in_background=True, **ARGS)
    engine = llm.engine
    engine.add_request(PROMPT, greedy(STEPS), request_id="r")
    outputs = []
    for step in range(STEPS):
        if step == 8:  # by now the bucket is captured: later steps replay it
            assert captured.wait(60)
        if step == 16:
            compiling.set()
            assert engine.graphs_ready(wait=True)
        outputs += engine.step()
    assert outputs[-1].finished and token_ids(outputs[-1:]) == eager
    steps = engine.stats().steps
    assert steps["graph"] >= 8, steps  # op by op from step 8 or earlier, compiled from 16
    folder = compile_cache.open_cache()
    assert folder is None or not compile_cache.untrusted(folder, compile_cache.cache_key())


def test_capture_sizes_follow_the_configured_batch():
    assert EngineConfig(model="m").batch_capture_sizes == (1, 2, 4, 8, 16, 32, 64)
    assert EngineConfig(model="m", max_num_seqs=10).batch_capture_sizes == (1, 2, 4, 8, 10)
    assert EngineConfig(model="m", max_num_seqs=1).batch_capture_sizes == (1,)
    assert EngineConfig(model="m", max_num_seqs=256).batch_capture_sizes[-1] == 64
    assert EngineConfig(model="m", max_num_batched_tokens=12).batch_capture_sizes[-1] == 12
    assert EngineConfig(model="m", capture_sizes=(3,)).batch_capture_sizes == (3,)


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    """An empty user cache directory, and a process that has not chosen its folder yet."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(compile_cache.INDUCTOR_CACHE_ENV, raising=False)
    compile_cache.open_cache.cache_clear()
    yield tmp_path
    compile_cache.open_cache.cache_clear()


def sealed_folder() -> tuple:
    """A folder as a start leaves it: inductor's files (stand-ins) and the manifest."""
    folder = compile_cache.open_cache()
    files = {"fxgraph/ab/entry": b"graph " * 50, "cd/kernel.so": b"\x7fELF" + bytes(300)}
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    compile_cache.seal(folder)
    compile_cache.open_cache.cache_clear()
    return folder, files


def test_compiled_runs_are_kept_in_a_versioned_folder_of_the_users_cache(cache_home):
    import torch

    folder, files = sealed_folder()
    assert folder.is_relative_to(cache_home / "updraft" / "compiled")
    assert torch.__version__ in str(folder)
    # A warm start trusts what it sealed and points inductor at it.
    assert compile_cache.open_cache() == folder
    assert all((folder / name).read_bytes() == data for name, data in files.items())
    assert compile_cache.os.environ[compile_cache.INDUCTOR_CACHE_ENV] == str(folder)


@pytest.mark.parametrize(
    "spoil",
    ["a corrupted file", "a file cut short", "a foreign file", "another torch's manifest"],
)
def test_a_corrupted_or_foreign_cached_artifact_is_never_loaded(cache_home, spoil, caplog):
    folder, _ = sealed_folder()
    if spoil == "a corrupted file":
        kernel = bytearray((folder / "cd/kernel.so").read_bytes())
        kernel[10] ^= 0xFF
        (folder / "cd/kernel.so").write_bytes(bytes(kernel))
    elif spoil == "a file cut short":
        (folder / "fxgraph/ab/entry").write_bytes(b"graph ")
    elif spoil == "a foreign file":
        (folder / "ef").mkdir()
        (folder / "ef/other.so").write_bytes(b"\x7fELF")
    else:
        manifest = json.loads((folder / compile_cache.MANIFEST).read_text())
        manifest["key"]["torch"] = "1.0"
        (folder / compile_cache.MANIFEST).write_text(json.dumps(manifest))
    # Removed before inductor reads the folder, so inductor compiles it again.
    spoiled = {
        "a corrupted file": ["cd/kernel.so"],
        "a file cut short": ["fxgraph/ab/entry"],
        "a foreign file": ["ef/other.so"],
        "another torch's manifest": ["cd/kernel.so", "fxgraph/ab/entry"],
    }[spoil]
    assert compile_cache.open_cache() == folder
    left = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    assert not left & set(spoiled)
    assert left - {compile_cache.MANIFEST} == {"cd/kernel.so", "fxgraph/ab/entry"} - set(spoiled)
    assert "not trusted" in caplog.text


def test_files_another_process_is_compiling_are_not_removed_under_it(cache_home):
    """Its files are not sealed until it ends: a start beside it leaves them, and the
    first start after it checks them."""
    import fcntl

    folder, _ = sealed_folder()
    unsealed = folder / "gh/being_written.so"
    unsealed.parent.mkdir()
    unsealed.write_bytes(b"\x7fELF")
    with open(folder.with_name(f"{folder.name}.lock"), "ab") as lock:
        fcntl.flock(lock, fcntl.LOCK_SH)  # as compile_cache.compiling holds it
        assert compile_cache.open_cache() == folder and unsealed.exists()
    compile_cache.open_cache.cache_clear()
    assert compile_cache.open_cache() == folder and not unsealed.exists()


def test_threads_of_one_process_seal_at_once(cache_home):
    """A target's graph worker and its draft's seal the same folder."""
    folder, _ = sealed_folder()
    failed = []

    def seal_often() -> None:
        try:
            for _ in range(20):
                compile_cache.seal(folder)
        except OSError as error:
            failed.append(error)

    threads = [threading.Thread(target=seal_often) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failed and not compile_cache.untrusted(folder, compile_cache.cache_key())
