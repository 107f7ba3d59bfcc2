"""Where inductor keeps the compiled runs between starts, and why it may trust them.

Inductor's own caches (its FX graph cache and AOTAutograd's) key each compiled graph by
its code, its inputs' shapes and torch's version, and a warm start loads from them
without compiling. By default they live in the system's temporary folder, which a reboot
clears; here they go to a folder in the user's cache directory instead::

    $XDG_CACHE_HOME (or ~/.cache) / updraft / compiled / v<FORMAT> /
        torch-<torch version>-<hash of the CPU's model and flags>

so a file built for another torch or another CPU (``-march=native``) is never found.
What inductor's keys lack is trust in the files themselves: a file cut short by a crash,
changed on disk, or put there by something else would be loaded and run. So the folder
is sealed as a start compiles (``seal``, after each bucket and at the end of
``compiling``: a manifest of every file's
size and SHA-256, and the key the folder was made for), and checked before inductor
reads it (``open_cache``): a file the manifest does not list (one written after the
last seal, or put there by something else) or lists with other contents is removed,
and so is every file of a folder whose manifest is missing or made for another key.
Inductor compiles again whatever it then does not find.

A ``TORCHINDUCTOR_CACHE_DIR`` the user set is theirs: it is used as it is.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import IO

from updraft.c_builds import cpu_signature

logger = logging.getLogger(__name__)

INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
MANIFEST = "updraft-manifest.json"
# The folder's version: bumped when what it holds changes meaning. (A change to the
# code of updraft's runs needs none: inductor keys each graph by its code.)
FORMAT = 1

_seal_lock = threading.Lock()


def cache_key() -> dict[str, str | int]:
    """What a compiled run depends on beyond what inductor keys it by (the CPU: its C++
    is built for this one)."""
    import torch

    cpu = hashlib.sha256(cpu_signature().encode()).hexdigest()[:16]
    return {"format": FORMAT, "torch": torch.__version__, "cpu": cpu}


def compile_cache_dir(key: dict[str, str | int] | None = None) -> Path:
    """The folder of this cache format, torch and CPU."""
    key = key or cache_key()
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    folder = f"torch-{key['torch']}-{key['cpu']}"
    return Path(root) / "updraft" / "compiled" / f"v{key['format']}" / folder


@cache
def open_cache() -> Path | None:
    """Points inductor at the checked folder (each file that failed the check removed)
    and returns it; None where the user chose inductor's folder themselves. Once per
    process. Another process compiling into the folder (``compiling``) writes files it
    has not sealed yet: the check is then left to the next start, and the folder used
    as the other process found it."""
    key = cache_key()
    folder = compile_cache_dir(key)
    chosen = os.environ.get(INDUCTOR_CACHE_ENV)
    if chosen not in (None, str(folder)) and not _is_inductor_default(chosen):
        return None
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    with _lock_file(folder) as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("%s is being compiled into by another process: not checked", folder)
        else:
            _remove_untrusted(folder, key)
    os.environ[INDUCTOR_CACHE_ENV] = str(folder)
    return folder


@contextmanager
def compiling(folder: Path | None) -> Iterator[None]:
    """While this process writes compiled runs into ``folder`` (a shared lock, which
    keeps another process's check from removing what is not sealed yet), then sealed."""
    if folder is None:
        yield
        return
    with _lock_file(folder) as lock:
        fcntl.flock(lock, fcntl.LOCK_SH)
        try:
            yield
        finally:
            seal(folder)


def _lock_file(folder: Path) -> IO[bytes]:
    """Beside the folder, so that it is in no manifest; closing it releases its lock."""
    return open(folder.with_name(f"{folder.name}.lock"), "ab")


def _remove_untrusted(folder: Path, key: dict[str, str | int]) -> None:
    distrusted = untrusted(folder, key)
    if distrusted:
        name, why = distrusted[0]
        logger.warning(
            "%d compiled files in %s not trusted (%s: %s), removed: they are compiled again",
            len(distrusted),
            folder,
            name,
            why,
        )
        for name, _ in distrusted:
            (folder / name).unlink(missing_ok=True)


def untrusted(folder: Path, key: dict[str, str | int]) -> list[tuple[str, str]]:
    """The files in ``folder`` that may not be loaded, each with why: every one where the
    manifest is missing or was made for another key, else those it does not list or
    lists with other contents. (Inductor compiles again what it then does not find.)"""
    files = _files(folder)
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError) as error:
        return [(name, f"no readable manifest: {error}") for name in files]
    made_for = manifest.get("key") if isinstance(manifest, dict) else None
    listed = manifest.get("files") if isinstance(manifest, dict) else None
    if made_for != key or not isinstance(listed, dict):
        return [(name, f"made for {made_for}, not {key}") for name in files]
    distrusted = []
    for name in files:
        if name not in listed:
            distrusted.append((name, "not in the manifest"))
        elif listed[name][:2] != _fingerprint(folder / name):
            distrusted.append((name, "differs from the manifest"))
    return distrusted


def seal(folder: Path) -> None:
    """Writes the manifest of every file now in ``folder``, for ``open_cache`` to check.
    A file the last seal listed with the same size and modification time keeps its
    hash (each start hashes every file again), so sealing costs the new files only.
    One at a time in a process: each runner's graph worker seals (a target's and its
    draft's at once)."""
    with _seal_lock:
        _seal(folder)


def _seal(folder: Path) -> None:
    key = cache_key()
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        kept = manifest["files"] if manifest["key"] == key else {}
    except (OSError, ValueError, KeyError, TypeError):
        kept = {}
    files = {}
    for name in _files(folder):
        stat = (folder / name).stat()
        entry = kept.get(name)
        if isinstance(entry, list) and entry[::2] == [stat.st_size, stat.st_mtime_ns]:
            files[name] = entry
        else:
            files[name] = [*_fingerprint(folder / name), stat.st_mtime_ns]
    text = json.dumps({"key": key, "files": files}, indent=0, sort_keys=True)
    partial = folder / f"{MANIFEST}.{os.getpid()}.tmp"
    partial.write_text(text)
    partial.replace(folder / MANIFEST)


def _files(folder: Path) -> list[str]:
    """Every file under ``folder`` but the manifest (and lock files inductor leaves)."""
    if not folder.is_dir():
        return []
    return sorted(
        path.relative_to(folder).as_posix()
        for path in folder.rglob("*")
        if path.is_file() and not path.name.startswith(MANIFEST) and path.suffix != ".lock"
    )


def _fingerprint(path: Path) -> list[int | str]:
    """[size, SHA-256]; a manifest entry adds the modification time it was taken at."""
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return [path.stat().st_size, digest.hexdigest()]


def _is_inductor_default(folder: str) -> bool:
    """Inductor writes its default folder into the environment on first use."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return os.path.abspath(folder) == os.path.abspath(default_cache_dir())
