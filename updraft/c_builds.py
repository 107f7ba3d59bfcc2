"""Compile updraft's C kernels with the machine's compiler, once, without torch.

Each kernel is one C file in ``updraft/kernels/`` (and the headers it includes from that
folder), with no dependency but the C library and OpenMP; it builds in one to two
seconds, into a per-user temporary folder, keyed by the sources, the flags and the CPU,
so an edit or another kind of CPU builds afresh. Built with the machine's own vector
instructions (-march=native).

Nothing here imports torch, so a start can set the compiler going before it imports
torch (``prebuild``), and the two take a core each: on a first start, importing torch
and building the float linears' kernel take about two seconds apiece. Loading a built
kernel is ``kernels/build.py``'s, after torch.

A build is one per library file across processes (a lock file beside it): ``serve``
starts the builds, and its engine process, which needs them, waits for them rather
than compiling them again.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from functools import cache
from pathlib import Path

SOURCES = Path(__file__).with_name("kernels")

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


# One lock per library file: a caller waits for the build a ``prebuild`` thread began.
_BUILDING: dict[Path, threading.Lock] = {}
_BUILDING_LOCK = threading.Lock()


def prebuild(names: tuple[str, ...], march: str = "native") -> list[str]:
    """Start building the kernels ``names`` that are not built yet, each in a thread of
    its own, and return at once -> the names it started: on a first start the compiler
    then runs beside torch's import and the model's loading, on as many cores as there
    are kernels. A load meanwhile waits for the build. A build that fails here fails
    again, with its message, where the kernel is loaded."""
    started = []
    for name in names:
        try:
            target = _Target.of(name, march)
        except RuntimeError:  # no compiler: said where the kernel is loaded
            continue
        lock = target.lock()
        if not target.library.is_file() and lock.acquire(blocking=False):
            threading.Thread(target=_build_then_release, args=(target, lock), daemon=True).start()
            started.append(name)
    return started


# What every model loads: the float linears' kernel and the paged attention's.
ENGINE_KERNELS = ("linear", "paged_attention")


def kernels_for(model: str | Path) -> tuple[str, ...]:
    """The kernels a model at ``model`` loads in any case: ``ENGINE_KERNELS``, and a
    GGUF file's block kernels."""
    gguf = ("gguf_int8", "gguf_blocks") if str(model).endswith(".gguf") else ()
    return (*ENGINE_KERNELS, *gguf)


@dataclass(frozen=True)
class _Target:
    """Where and how one kernel builds for one ``-march``."""

    name: str
    source: Path
    compiler: str
    compile_flags: tuple[str, ...]
    library: Path

    @classmethod
    def of(cls, name: str, march: str) -> _Target:
        """Read once per process (a prebuild and the load after it ask alike, and every
        engine prebuilds), for each temporary folder it may build in."""
        return _target(name, march, tempfile.gettempdir())

    def lock(self) -> threading.Lock:
        """Held while this process builds the library."""
        with _BUILDING_LOCK:
            return _BUILDING.setdefault(self.library, threading.Lock())

    def build_once(self) -> None:
        """Build the library unless it is there; where another process is building it,
        wait for that build and use it."""
        if self.library.is_file():
            return
        self.library.parent.mkdir(mode=0o700, exist_ok=True)
        with open(self.library.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released as the file closes, or its process ends
            if not self.library.is_file():
                self.build()

    def build(self) -> None:
        # Per process and thread: two processes' first calls may build at once.
        partial = self.library.with_suffix(f".{os.getpid()}-{threading.get_ident()}.tmp")
        objects = partial.with_suffix(".o")
        for command in (
            [self.compiler, *self.compile_flags, str(self.source), "-o", str(objects)],
            [self.compiler, *LINK, str(objects), "-o", str(partial), *LIBRARIES],
        ):
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(
                    f"building the {self.name} kernel failed:\n{done.stderr[-2000:]}"
                )
        objects.unlink()
        partial.replace(self.library)  # atomic: concurrent builders leave one whole file


@cache
def _target(name: str, march: str, temporary: str) -> _Target:
    source = SOURCES / f"{name}.c"
    compiler = _compiler()
    compile_flags = tuple(f"-march={march}" if f == "-march=native" else f for f in COMPILE)
    flags = " ".join([compiler, *compile_flags, *LINK, *LIBRARIES, cpu_signature()])
    # the headers beside the sources are part of every kernel that includes them
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    key = hashlib.sha256(source.read_bytes() + headers + flags.encode())
    folder = Path(temporary) / f"updraft-kernels-{os.getuid()}"
    library = folder / f"{name}-{key.hexdigest()[:16]}.so"
    return _Target(name, source, compiler, compile_flags, library)


def _build_then_release(target: _Target, lock: threading.Lock) -> None:
    try:
        with contextlib.suppress(RuntimeError):  # said again where the kernel is loaded
            target.build_once()
    finally:
        lock.release()


def built(name: str, march: str = "native") -> Path:
    """The library file of ``<name>.c`` for ``march``, built unless it is there (or
    waited for, where this process or another is building it)."""
    target = _Target.of(name, march)
    with target.lock():
        target.build_once()
    return target.library
