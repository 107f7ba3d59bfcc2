"""Finding a checkpoint on disk: a directory as given, a GGUF file (as the directory
``checkpoints/gguf.py`` makes of it), or a Hugging Face Hub id whose snapshot is already
in the local Hugging Face cache. Nothing is ever downloaded."""

from __future__ import annotations

import os
import re
from pathlib import Path

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def hub_cache() -> Path:
    """Where ``huggingface_hub`` keeps downloads, by its own environment variables."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache.expanduser() / "huggingface" / "hub"


def local_checkpoint(name: str) -> str:
    """``name`` when it is a directory; for a GGUF file, the directory that stands for
    it; for a Hub id (``org/model``) that is not one, the cached snapshot its ``main``
    ref names (or its only snapshot)."""
    if name.endswith(".gguf") and Path(name).expanduser().is_file():
        from updraft.checkpoints.gguf import checkpoint_dir

        return checkpoint_dir(name)
    if Path(name).expanduser().is_dir() or not HUB_ID.fullmatch(name):
        return name
    repo = hub_cache() / f"models--{name.replace('/', '--')}"
    ref = repo / "refs" / "main"
    if ref.is_file() and (repo / "snapshots" / ref.read_text().strip()).is_dir():
        return str(repo / "snapshots" / ref.read_text().strip())
    snapshots = sorted((repo / "snapshots").glob("*/")) if repo.is_dir() else []
    if len(snapshots) == 1:
        return str(snapshots[0])
    raise FileNotFoundError(
        f"{name!r} is not a local directory, and the Hugging Face cache ({hub_cache()}) has "
        f"no snapshot of it. updraft loads checkpoints from disk and never downloads: fetch "
        f"it first (for example `hf download {name} --local-dir DIR`) and pass DIR"
    )
