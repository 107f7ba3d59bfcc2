"""A GGUF file as a checkpoint directory: ``LLM("model.gguf")`` and ``--model model.gguf``.

The file's metadata becomes the files every other part of updraft reads from a
checkpoint directory: ``config.json`` (the architecture and sizes, as transformers would
write them), ``generation_config.json`` (the ids that end a turn) and, where the file carries one,
``tokenizer_config.json`` with its chat template. They are written once per file into a
cache directory beside a ``gguf.json`` that names the file (and its split parts); the
weights stay in the file, memory-mapped, and ``models/gguf_loader.py`` reads them from
there in their own block layout. The config comes from the parser of the family whose
registry row names the file's architecture.

A file of another architecture, or a tensor type the kernels cannot read, is refused
here, by name, before anything is loaded.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

from updraft.checkpoints.gguf_header import read_gguf
from updraft.checkpoints.gguf_sizes import check_sizes
from updraft.checkpoints.gguf_vocab.ids import check_vocabulary, named_token_ids
from updraft.model_config import ModelConfig, registry

# Tensor types read: the float ones as tensors, the rest in their blocks.
FLOAT_TYPES = ("F32", "F16", "BF16")
# The block types read (``kernels/gguf_ops.py`` takes its list from here).
BLOCK_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "MXFP4")  # of 32 values
BLOCK_TYPES += ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")  # blocks of 256
SPLIT = re.compile(r"(.*)-(\d{5})-of-(\d{5})\.gguf")
LINK = "gguf.json"
# Bumped when what is written into a cached directory changes.
LAYOUT_VERSION = 4

log = logging.getLogger(__name__)


def is_gguf(name: str) -> bool:
    return name.endswith(".gguf") and Path(name).expanduser().is_file()


def gguf_parts(path: Path) -> list[Path]:
    """A file, or every part of a split file (``name-00001-of-00003.gguf``) given any."""
    match = SPLIT.fullmatch(path.name)
    if match is None:
        return [path]
    stem, count = match[1], int(match[3])
    parts = [path.with_name(f"{stem}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [str(part) for part in parts if not part.is_file()]
    if missing:
        raise FileNotFoundError(f"split GGUF {path.name} lacks its part(s) {missing}")
    return parts


# Where the directories standing for GGUF files are written, when not the default.
CACHE_ENV = "UPDRAFT_GGUF_CACHE"


def cache_root() -> Path:
    """``$UPDRAFT_GGUF_CACHE``, else ``updraft/gguf`` in the user's cache directory."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser()
    return cache / "updraft" / "gguf"


def checkpoint_dir(name: str) -> str:
    """The checkpoint directory that stands for the GGUF file ``name``, written on first
    use (and again whenever the file changes)."""
    parts = gguf_parts(Path(name).expanduser().resolve())
    key = hashlib.sha256(str(LAYOUT_VERSION).encode())
    for part in parts:
        stat = part.stat()
        key.update(f"{part}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
    directory = cache_root() / key.hexdigest()[:24]
    if not (directory / LINK).is_file():
        files = describe(parts)
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        for file_name, content in files.items():
            text = content if isinstance(content, str) else json.dumps(content, indent=1)
            (directory / file_name).write_text(text)
    return str(directory)


def linked_files(model_dir: Path) -> list[Path] | None:
    """The GGUF files a checkpoint directory stands for, or None for an ordinary one."""
    link = Path(model_dir) / LINK
    if not link.is_file():
        return None
    return [Path(p) for p in json.loads(link.read_text())["files"]]


def linked_block_types(model_dir: Path) -> list[str] | None:
    """The block types (``BLOCK_TYPES``' names) of the tensors of the GGUF file a
    checkpoint directory stands for (none for a float file), or None for an ordinary
    directory."""
    link = Path(model_dir) / LINK
    if not link.is_file():
        return None
    return json.loads(link.read_text())["block_types"]


# Small tensors that are part of a model's config rather than its weights: llama.cpp's
# per-frequency RoPE factors (Llama 3.1's scaling; Phi-3's LongRoPE). Their values reach
# the family's parser (``GGUFTensors.values_of``) and the loader leaves them out.
CONFIG_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


class GGUFTensors(dict):
    """A file's tensors: name -> (type name, shape as transformers orders it: rows
    first), and the values of its ``CONFIG_TENSORS``."""

    def __init__(self) -> None:
        super().__init__()
        self.config_values: dict[str, tuple[float, ...]] = {}

    def values_of(self, name: str) -> tuple[float, ...]:
        """The values of the config tensor ``name``."""
        return self.config_values[name]


def metadata(parts: list[Path]) -> tuple[dict[str, Any], GGUFTensors]:
    """The first part's key-value metadata, and every part's tensors."""
    import numpy as np

    fields: dict[str, Any] = {}
    tensors = GGUFTensors()
    for index, part in enumerate(parts):
        reader = read_gguf(part)
        if index == 0:
            fields = dict(reader.fields)
        for tensor in reader.tensors:
            shape = tuple(reversed(tensor.shape))
            tensors[tensor.name] = (tensor.tensor_type.name, shape)
            if tensor.name in CONFIG_TENSORS:
                if tensor.tensor_type.name not in ("F32", "F16") or len(shape) != 1:
                    raise ValueError(
                        f"{part.name}: {tensor.name} must be a float vector, got "
                        f"{tensor.tensor_type.name} of shape {shape}"
                    )
                values = np.asarray(tensor.data).astype(np.float32)
                tensors.config_values[tensor.name] = tuple(float(v) for v in values)
    return fields, tensors


def describe(parts: list[Path]) -> dict[str, Any]:
    """The files of the checkpoint directory that stands for ``parts``: each a value
    to write as JSON, or JSON text already."""
    fields, tensors = metadata(parts)
    arch = fields.get("general.architecture")
    row = registry.for_gguf(arch, parts[0].name)
    unread = sorted({kind for kind, _ in tensors.values()} - {*FLOAT_TYPES, *BLOCK_TYPES})
    if unread:
        raise ValueError(
            f"{parts[0].name}: GGUF tensor type(s) {', '.join(unread)} are not supported "
            f"({', '.join(FLOAT_TYPES + BLOCK_TYPES)} are)"
        )

    check_sizes(parts[0].name, arch, fields, tensors)

    def get(key: str, default: Any = None) -> Any:
        return fields.get(f"{arch}.{key}", default)

    config = {**row.from_gguf(parts[0].name, row.name, get, tensors), "model_type": arch}
    config.update(named_token_ids(parts[0].name, fields, config["vocab_size"], ("bos", "eos")))
    try:  # refused now, by the file's name, rather than as the config.json it becomes
        ModelConfig.from_dict(config)
    except ValueError as error:
        message = str(error).removeprefix("config.json: ")
        raise ValueError(f"{parts[0].name}: the config its metadata gives: {message}") from None
    files: dict[str, Any] = {
        LINK: {
            "files": [str(part) for part in parts],
            "architecture": arch,
            "block_types": sorted({kind for kind, _ in tensors.values()} & {*BLOCK_TYPES}),
        },
        "config.json": config,
    }
    from updraft.checkpoints.gguf_vocab import rebuild, tokenizer_config
    from updraft.checkpoints.gguf_vocab.stops import stop_token_ids

    stops = stop_token_ids(fields)
    if stops:
        files["generation_config.json"] = {"eos_token_id": stops}

    try:
        check_vocabulary(fields)
        tokenizer, why_not = rebuild(fields)
    except ValueError as error:  # a vocabulary the file holds but cannot be read
        raise ValueError(f"{parts[0].name}: {error}") from None
    if tokenizer is None:
        log.warning("%s: no tokenizer (%s); prompts must be token ids", parts[0].name, why_not)
    else:
        files["tokenizer.json"] = tokenizer  # the library's own JSON text, written as it is
    files["tokenizer_config.json"] = tokenizer_config(fields)
    return files
