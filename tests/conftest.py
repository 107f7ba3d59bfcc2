"""Shared fixtures: the tiny checkpoints (built by tests/checkpoints.py) most tests run,
and the settings every test process starts with."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

# The suite runs in two worker processes (pytest-xdist, pyproject's addopts), one per
# core: each keeps to one thread, or two workers' thread pools would take turns on
# the cores and spin waiting for each other. The servers, CLIs and ranks the tests
# start inherit it. Tests of multithreaded kernels ask for their threads themselves.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch
from hypothesis import settings

from tests.checkpoints import DEEPSEEK, build_checkpoint

# CI replays the same examples every run, so a red CI always reproduces; locally each
# run explores new ones.
settings.register_profile("ci", derandomize=True)

# Engines here replay captured steps op by op: compiling them with inductor would cost
# seconds per engine. The tests of compiled runs ask for them explicitly, and
# UPDRAFT_COMPILE_GRAPHS=1 runs the whole suite compiled. Set before any engine starts,
# so the servers and CLIs the tests start inherit it.
os.environ.setdefault("UPDRAFT_COMPILE_GRAPHS", "0")
# One mixed-bucket size instead of five (EngineConfig.capture_tokens): every engine the
# suite starts would otherwise capture five more graphs, minutes over the whole suite.
# Steps of up to 32 tokens (most of the suite's prefills) still replay one.
os.environ.setdefault("UPDRAFT_CAPTURE_TOKENS", "32")
# Every graph captured (and compiled) before the engine's first step, as the tests of
# replays expect from their first step; test_startup.py makes them in the background.
os.environ.setdefault("UPDRAFT_GRAPHS_IN_BACKGROUND", "0")
# The directories that stand for the tests' GGUF files go to a folder of the run's own,
# removed at the end, not into the user's cache.
os.environ["UPDRAFT_GGUF_CACHE"] = tempfile.mkdtemp(prefix="updraft-gguf-")
atexit.register(shutil.rmtree, os.environ["UPDRAFT_GGUF_CACHE"], ignore_errors=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture(scope="session", params=sorted(DEEPSEEK))
def tiny_deepseek(request, tmp_path_factory) -> tuple[str, Path]:
    kind = request.param
    return kind, build_checkpoint(kind, tmp_path_factory.mktemp(kind))


@pytest.fixture(scope="session", params=["llama", "qwen2", "qwen3"])
def tiny_checkpoint(request, tmp_path_factory) -> tuple[str, Path]:
    kind = request.param
    return kind, build_checkpoint(kind, tmp_path_factory.mktemp(kind))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return build_checkpoint("llama", tmp_path_factory.mktemp("llama"))


def add_byte_tokenizer(model_dir: Path) -> Path:
    """A byte-level tokenizer with exactly 256 tokens (no merges), so the tiny models,
    whose vocabulary is 256, can take and return text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(model_dir / "tokenizer.json"))
    return model_dir


@pytest.fixture
def all_cores():
    """Every core's thread for one test, even in a one-thread worker: the C kernels
    split their rows over torch's thread count, and a kernel run on one thread would
    leave the split itself untested."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(2, os.cpu_count() or 1))
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_llama_with_tokenizer(tmp_path_factory) -> Path:
    model_dir = build_checkpoint("llama", tmp_path_factory.mktemp("llama_text"))
    return add_byte_tokenizer(model_dir)


@pytest.fixture(scope="module")
def pool():
    """A module's worker processes: each engine's other ranks run on them, one engine
    after another, instead of on processes of its own."""
    from updraft import WorkerPool

    workers = WorkerPool()
    yield workers
    workers.close()
