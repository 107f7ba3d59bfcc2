"""Kernels built ahead: ``prebuild`` compiles in the background, and a load of the same
kernel meanwhile waits for that build instead of compiling it a second time."""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from updraft import c_builds
from updraft.kernels import build

# A target no other test builds for, so this process has not loaded it already.
MARCH = "x86-64-v2"


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs a C compiler for the kernels")
@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps")
def test_a_load_during_a_prebuild_waits_for_it_and_compiles_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    commands = []
    real_run = subprocess.run

    def counted(command, **kwargs):
        commands.append((command, threading.current_thread() is threading.main_thread()))
        time.sleep(0.2)  # long enough for the load below to find the build under way
        return real_run(command, **kwargs)

    monkeypatch.setattr(c_builds.subprocess, "run", counted)
    c_builds.prebuild(("token_mask",), MARCH)
    library = build.load("token_mask", MARCH)
    # One compile and one link, both in the prebuild's thread, for the target asked.
    assert [in_main for _, in_main in commands] == [False, False], commands
    assert any(MARCH in part for part in commands[0][0])
    built = list(tmp_path.glob("updraft-kernels-*/token_mask-*.so"))
    assert len(built) == 1 and library is not None
    assert str(built[0]) in Path("/proc/self/maps").read_text()  # the one loaded
    assert not list(tmp_path.glob("updraft-kernels-*/*.tmp"))


def test_a_gguf_file_prebuilds_its_block_kernels_too():
    assert c_builds.kernels_for("model.gguf")[-2:] == ("gguf_int8", "gguf_blocks")
    assert "gguf_int8" not in c_builds.kernels_for("checkpoint-dir")
    assert {"linear", "paged_attention"} <= set(c_builds.kernels_for("checkpoint-dir"))


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs a C compiler for the kernels")
def test_a_build_another_process_has_under_way_is_waited_for_not_repeated(tmp_path, monkeypatch):
    """``serve`` starts the builds and its engine process waits for them: a builder
    holding the library's lock file makes every other wait, then use its library."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    library = c_builds.built("token_mask", MARCH)
    kept = library.read_bytes()
    library.unlink()
    compiles = []
    monkeypatch.setattr(c_builds.subprocess, "run", lambda *a, **k: compiles.append(a))
    found = []
    with open(library.with_suffix(".lock"), "a") as lock:  # another builder's, meanwhile
        fcntl.flock(lock, fcntl.LOCK_EX)
        waiting = threading.Thread(target=lambda: found.append(c_builds.built("token_mask", MARCH)))
        waiting.start()
        waiting.join(0.5)
        assert waiting.is_alive() and not found  # it waits for the lock
        library.write_bytes(kept)  # the other builder's library, whole
    waiting.join(10)
    assert found == [library] and not compiles


def test_the_builder_imports_no_torch():
    """A start sets the compiler going before it imports torch: the two take a core each."""
    code = (
        "import sys, updraft.c_builds, updraft.cli, updraft.serve.launch\n"
        "print('torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
