"""Compile a kernel's C source with the machine's compiler, once, and load it.

Each kernel is one C file beside this one (and the headers it includes from this
folder), with no dependency but the C library and OpenMP; it builds in about a second,
into a per-user temporary folder, keyed by the sources, the flags and the CPU, so an
edit or another kind of CPU builds afresh. Built with the machine's own vector
instructions (-march=native).

torch is imported before a kernel loads, so the kernel's ``libgomp.so.1`` resolves to
the OpenMP runtime torch already loaded (same soname): one thread pool for both.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from functools import cache
from pathlib import Path

import torch  # noqa: F401 (loads torch's OpenMP runtime first; see above)

# -ffast-math lets reductions and exp vectorise (glibc's vector exp); the kernels keep
# every value finite, so its no-inf/no-NaN assumption holds. It is a compile flag only:
# linked with it, gcc adds crtfastmath.o, which flushes subnormals to zero in the whole
# process at load time.
COMPILE = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-c")
LINK = ("-shared", "-fopenmp")
LIBRARIES = ("-lmvec", "-lm")  # after the objects: the linker resolves left to right


def _compiler() -> str:
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise RuntimeError("updraft's CPU kernels need a C compiler (gcc or cc) on PATH")
    return compiler


def cpu_signature() -> str:
    """What -march=native builds for: a kernel is never reused on another kind of CPU,
    even from a temporary folder that machines share."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = ("model name", "flags", "Features")
    return "".join(sorted({line for line in info.splitlines() if line.startswith(wanted)}))


@cache
def load(name: str, march: str = "native") -> ctypes.CDLL:
    """The compiled ``<name>.c``, built on first use. ``march``: the instructions to
    build for (another than the machine's own lets a test run a kernel's narrower
    paths: ``haswell`` for AVX2, ``x86-64`` for none)."""
    source = Path(__file__).with_name(f"{name}.c")
    compiler = _compiler()
    compile_flags = [f"-march={march}" if f == "-march=native" else f for f in COMPILE]
    flags = " ".join([compiler, *compile_flags, *LINK, *LIBRARIES, cpu_signature()])
    # the headers beside the sources are part of every kernel that includes them
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    key = hashlib.sha256(source.read_bytes() + headers + flags.encode())
    folder = Path(tempfile.gettempdir()) / f"updraft-kernels-{os.getuid()}"
    library = folder / f"{name}-{key.hexdigest()[:16]}.so"
    if not library.is_file():
        folder.mkdir(mode=0o700, exist_ok=True)
        # Per process and thread: two threads' first calls may build at once.
        partial = library.with_suffix(f".{os.getpid()}-{threading.get_ident()}.tmp")
        objects = partial.with_suffix(".o")
        for command in (
            [compiler, *compile_flags, str(source), "-o", str(objects)],
            [compiler, *LINK, str(objects), "-o", str(partial), *LIBRARIES],
        ):
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"building the {name} kernel failed:\n{done.stderr[-2000:]}")
        objects.unlink()
        partial.replace(library)  # atomic: concurrent builders leave one whole file
    try:
        return ctypes.CDLL(str(library))
    except OSError as error:
        raise RuntimeError(f"loading the {name} kernel failed: {error}") from error


@cache
def kernel_builds(name: str) -> bool:
    """Whether kernel ``name`` ("linear", "paged_attention", "token_mask", ...) builds and
    loads here (a C compiler is on PATH). Answered once per process: a failed build would
    otherwise be tried again by every caller."""
    try:
        load(name)
    except RuntimeError:
        return False
    return True
