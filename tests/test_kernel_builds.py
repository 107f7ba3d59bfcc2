"""Kernels built ahead: ``prebuild`` compiles in the background, and a load of the same
kernel meanwhile waits for that build instead of compiling it a second time."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

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

    monkeypatch.setattr(build.subprocess, "run", counted)
    build.prebuild(("token_mask",), MARCH)
    library = build.load("token_mask", MARCH)
    # One compile and one link, both in the prebuild's thread, for the target asked.
    assert [in_main for _, in_main in commands] == [False, False], commands
    assert any(MARCH in part for part in commands[0][0])
    built = list(tmp_path.glob("updraft-kernels-*/token_mask-*.so"))
    assert len(built) == 1 and library is not None
    assert str(built[0]) in Path("/proc/self/maps").read_text()  # the one loaded
    assert not list(tmp_path.glob("updraft-kernels-*/*.tmp"))


def test_a_gguf_file_prebuilds_its_block_kernels_too():
    assert build.kernels_for("model.gguf")[-2:] == ("gguf_int8", "gguf_blocks")
    assert "gguf_int8" not in build.kernels_for("checkpoint-dir")
    assert {"linear", "paged_attention"} <= set(build.kernels_for("checkpoint-dir"))
