"""The memory report (``updraft doctor --memory``), the weights' memory flags
(``--no-mmap``, ``--mlock``) and what ``import updraft`` loads."""

from __future__ import annotations

import mmap
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import greedy
from updraft import LLM
from updraft.engine.memory_report import build_report
from updraft.models.weight_memory import (
    lock_in_memory,
    read_into_memory,
    release_unkept_pages,
)
from updraft.resident import (
    PAGE,
    ImportBaseline,
    Phase,
    mappings,
    recording_phases,
    resident_pages,
)

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/smaps").exists(), reason="reads /proc/self/smaps and mincore"
)
SERVER_STACK = ("fastapi", "uvicorn", "starlette", "transformers", "zmq", "msgpack")


def test_the_offline_api_imports_no_server_stack():
    code = (
        "import sys, updraft\nfrom updraft import LLM, SamplingParams\nimport updraft.cli\n"
        "import updraft.engine.engine\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {SERVER_STACK!r}))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_resident_pages_are_the_pages_written():
    memory = mmap.mmap(-1, 64 * PAGE)
    tensor = torch.frombuffer(memory, dtype=torch.uint8)
    start = tensor.data_ptr()
    assert len(resident_pages([(start, start + 64 * PAGE)])) == 0
    tensor[5 * PAGE : 9 * PAGE + 1] = 1  # pages 5..9
    pages = resident_pages([(start, start + 64 * PAGE), (start + 6 * PAGE, start + 8 * PAGE)])
    assert list(pages - start // PAGE) == [5, 6, 7, 8, 9]
    del tensor
    memory.close()


@pytest.fixture(scope="module")
def engine_report(tiny_llama):
    with recording_phases() as log:
        llm = LLM(tiny_llama, kv_cache_memory_gib=0.25, enforce_eager=True)
        log.mark("engine ready")
        llm.generate([list(range(1, 40))], greedy(24))
    report = build_report(llm.engine.memory(), ImportBaseline(0, 0), log.phases, log.start_rss)
    return llm, report


def test_the_report_counts_each_part_from_the_engine_s_own_tensors(engine_report):
    llm, report = engine_report
    owned = llm.engine.memory()
    weights = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in owned.weights
        if not t.is_mkldnn
    }
    parts = report.parts
    # the loaded weights are written in full: all resident, in a page or two of slack each
    assert sum(weights.values()) <= parts["weights: copies in memory"]
    assert parts["weights: copies in memory"] <= sum(weights.values()) + 2 * PAGE * len(weights)
    # the KV cache is mapped as blocks fill: the request's blocks, not the 0.25 GiB
    block_bytes = report.kv_allocated // (llm.engine.stats().kv_blocks_total + 1)
    assert 4 * block_bytes // 2 <= parts["KV cache"] < report.kv_allocated // 8
    assert parts["captured graphs (arenas, inputs, outputs)"] == 0  # eager
    assert sum(parts.values()) == report.rss
    assert [phase.name for phase in report.phases][-3:] == [
        "weights loaded",
        "KV cache allocated",
        "engine ready",
    ]


def test_the_peak_is_split_at_the_phase_that_reached_it():
    from updraft.engine.memory_report import MemoryReport

    phases = [Phase("a", 100, 150), Phase("b", 120, 400), Phase("c", 110, 130)]
    report = MemoryReport(rss=110, peak=400, parts={}, phases=phases, phase_start=50)
    assert report.peak_split() == ("b", 100, 300)


@pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")
def test_no_mmap_copies_mapped_weights_and_mlock_locks_them(tmp_path):
    size = 8 * PAGE
    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(range(256)) * (size // 256))
    mapped = torch.from_numpy(__import__("numpy").memmap(path, dtype="uint8", mode="r"))
    module = torch.nn.Module()
    module.register_buffer("table", mapped.view(8, PAGE)[2:6], persistent=False)
    module.register_buffer("own", torch.ones(3), persistent=False)
    files = [m for m in mappings() if m.path == str(path)]
    assert files and files[0].start <= module.table.data_ptr() < files[0].end
    before = module.table.clone()
    assert read_into_memory(module) == size  # the whole storage the view lies in
    assert not any(m.start <= module.table.data_ptr() < m.end for m in mappings() if m.file_backed)
    assert torch.equal(module.table, before) and module.table.stride() == (PAGE, 1)
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft != resource.RLIM_INFINITY and soft < 4 * size:
        pytest.skip(f"RLIMIT_MEMLOCK ({soft} bytes) is below what the test locks")
    assert lock_in_memory(module) >= size


@pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")
def test_a_weight_file_s_pages_that_no_weight_views_are_dropped(tmp_path):
    import numpy as np

    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(16 * PAGE))
    whole = torch.from_numpy(np.memmap(path, dtype="uint8", mode="c"))
    assert int(whole.sum()) == 0  # every page read, so resident
    module = torch.nn.Module()
    module.register_buffer("kept", whole[5 * PAGE : 7 * PAGE + 10], persistent=False)

    def mapped() -> int:  # this process's resident pages of the file (mincore would
        # say the page cache's)
        return sum(m.rss for m in mappings() if m.path == str(path)) // PAGE

    assert mapped() == 16
    assert release_unkept_pages(module) == 13 * PAGE  # pages 5, 6 and 7 kept
    assert mapped() == 3
    assert int(module.kept.sum()) == 0 and int(whole.sum()) == 0  # read back from the file
    assert mapped() == 16


def test_mlock_refused_names_rlimit_memlock(monkeypatch):
    """The error a user sees when the OS refuses (as root, CAP_IPC_LOCK passes any
    limit, so the refusal is the OS's answer stood in for)."""
    import errno

    from updraft.models import weight_memory

    module = torch.nn.Module()
    module.register_buffer("table", torch.ones(4 * PAGE // 4), persistent=False)
    monkeypatch.setattr(weight_memory, "_mlock", lambda start, length: errno.ENOMEM)
    with pytest.raises(
        ValueError, match=r"--mlock: .*ENOMEM.*RLIMIT_MEMLOCK is (\d+ bytes|unlimited)"
    ):
        lock_in_memory(module)


def test_doctor_memory_prints_the_parts_and_the_peak_s_phase(tiny_llama, capsys):
    from updraft.cli import main

    argv = ["doctor", "--memory", "--model", str(tiny_llama), "--enforce-eager"]
    assert main([*argv, "--num-kv-blocks", "64"]) == 0
    out = capsys.readouterr().out
    for part in ("weights: copies in memory", "KV cache", "torch import", "other"):
        assert part in out
    assert "the peak came in" in out and "weights loaded" in out
