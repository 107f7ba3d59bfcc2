"""Compiled runs kept as their kernel calls, so that a warm start never imports inductor.

Inductor's own cache makes a warm start quick, but loading from it imports inductor and
dynamo: about 115 MiB resident and a few hundred milliseconds of a start, for runs whose
every call is a C++ kernel (``graph/frozen_calls.py``). So each run inductor compiles is
also kept as its ``RunCalls``, one JSON file per run in the checked compile cache folder
(``graph/compile_cache.py``, which seals and checks these files with inductor's)::

    <folder>/updraft-runs/<hash of the run's graph code and its inputs' layouts>.json

naming each kernel by its shared library, relative to the folder. A later start that
finds the file loads those libraries with ``importlib`` (they are Python extension
modules inductor built) and binds them, without inductor.

A file is loaded only if every part of it is what ``save`` writes: indices within the
run's inputs and buffers, known dtypes, libraries inside the folder. Anything else is
logged and the run compiled again, and its file written anew.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from updraft.graph.frozen_calls import DTYPES, Buffer, KernelCall, RunCalls, Source

logger = logging.getLogger(__name__)

FOLDER = "updraft-runs"
# The files' version: bumped when what a file holds changes meaning.
FORMAT = 1
# Inductor's kernels find tensors' data through a function of torch's, whose address
# they read from this variable as they load.
DATA_POINTER_ENV = "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"

_load_lock = threading.Lock()


def run_name(code: str, layouts: Sequence[Any]) -> str:
    """The file name of a run: its graph's code and its inputs' shapes, strides, offsets
    and dtypes, as the process-wide cache of compiled runs keys it."""
    return hashlib.sha256(repr((code, tuple(layouts))).encode()).hexdigest()[:32] + ".json"


def save(folder: Path, name: str, run: RunCalls) -> bool:
    """Writes ``run`` under ``folder``; False (nothing written) where one of its kernels
    is not a library inside ``folder``."""
    files = [kernel_file(call.kernel, folder) for call in run.calls]
    if None in files:
        return False
    text = json.dumps(
        {
            "format": FORMAT,
            "inputs": run.inputs,
            "buffers": [list(buffer) for buffer in run.buffers],
            "calls": [[file, call.arguments] for file, call in zip(files, run.calls, strict=True)],
        }
    )
    path = folder / FOLDER / name
    path.parent.mkdir(exist_ok=True)
    partial = path.with_name(f"{name}.{os.getpid()}.{threading.get_ident()}.tmp")
    partial.write_text(text)
    partial.replace(path)
    return True


def kernel_file(kernel: Callable[..., Any], folder: Path) -> str | None:
    """The library ``kernel`` was loaded from, relative to ``folder``, or None."""
    file = getattr(getattr(kernel, "__self__", None), "__file__", None)
    if not isinstance(file, str) or not file.endswith(".so"):
        return None
    path = Path(file).resolve()
    root = folder.resolve()
    return path.relative_to(root).as_posix() if path.is_relative_to(root) else None


def load(folder: Path, name: str, inputs: int) -> RunCalls | None:
    """The run kept under ``name`` with its kernels loaded, or None where there is none,
    or it is not what ``save`` writes for a run of ``inputs`` inputs (logged)."""
    path = folder / FOLDER / name
    if not path.is_file():
        return None
    try:
        return _parse(json.loads(path.read_text()), folder, inputs)
    except Exception as error:  # any flaw: compiled again
        why = f"{type(error).__name__}: {error}"
        logger.warning("kept compiled run %s not loaded (%s): compiled again", path, why)
        return None


def _parse(data: Any, folder: Path, inputs: int) -> RunCalls:
    _check(isinstance(data, dict) and data.get("format") == FORMAT, "another format")
    _check(data.get("inputs") == inputs, f"made for {data.get('inputs')} inputs, not {inputs}")
    buffers = []
    for entry in data["buffers"]:
        size, stride, dtype = entry
        _check(_ints(size) and _ints(stride) and len(size) == len(stride), "a buffer's shape")
        _check(all(n >= 0 for n in size + stride) and dtype in DTYPES, "a buffer's shape")
        buffers.append(Buffer(size, stride, dtype))
    calls = []
    for file, arguments in data["calls"]:
        _check(isinstance(arguments, list), "a call's arguments")
        for source in arguments:
            _check_source(source, inputs, len(buffers))
        calls.append(KernelCall(load_kernel(_library(folder, file)), arguments))
    _check(bool(calls), "no call")
    return RunCalls(inputs, buffers, calls)


def _check_source(source: Source, inputs: int, buffers: int) -> None:
    _check(isinstance(source, list) and bool(source), f"an argument {source!r}")
    kind = source[0]
    if kind in ("input", "buffer") and len(source) == 2:
        bound = inputs if kind == "input" else buffers
        _check(_ints([source[1]]) and 0 <= source[1] < bound, f"{kind} {source[1]}")
    elif kind == "view" and len(source) == 5:
        _check_source(source[1], inputs, buffers)
        size, stride, offset = source[2:]
        _check(_ints(size) and _ints(stride) and _ints([offset]), "a view's shape")
        _check(len(size) == len(stride) and min(size + stride + [offset], default=0) >= 0, "a view")
    elif kind == "int" and len(source) == 2:
        _check(_ints([source[1]]), "an int")
    elif kind == "float" and len(source) == 2:
        _check(isinstance(source[1], float), "a float")
    else:
        _check(False, f"an argument {source!r}")


def _ints(values: Any) -> bool:
    return isinstance(values, list) and all(
        isinstance(n, int) and not isinstance(n, bool) for n in values
    )


def _library(folder: Path, file: Any) -> Path:
    _check(isinstance(file, str) and file.endswith(".so"), f"a kernel {file!r}")
    path = (folder / file).resolve()
    _check(path.is_relative_to(folder.resolve()) and path.is_file(), f"no library {file}")
    return path


def _check(condition: bool, what: str) -> None:
    if not condition:
        raise ValueError(what)


def load_kernel(path: Path) -> Callable[..., Any]:
    """The ``kernel`` function of one of inductor's libraries, loaded as inductor loads it
    (under the same module name, so a process that has both finds one module)."""
    name = f"{path.name.split('.')[0]}.kernel"
    with _load_lock:
        module = sys.modules.get(name)
        if module is None:
            os.environ[DATA_POINTER_ENV] = str(
                torch._C._dynamo.guards._torchinductor_pyobject_tensor_data_ptr
            )
            spec = importlib.util.spec_from_file_location(name, path)
            _check(spec is not None and spec.loader is not None, f"{path} is not a module")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            sys.modules[name] = module
    return module.kernel


def forget(folder: Path, name: str) -> None:
    """Removes a kept run that failed its check, so the next start compiles it again."""
    (folder / FOLDER / name).unlink(missing_ok=True)
