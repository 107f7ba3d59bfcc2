"""The sizes a GGUF file's metadata gives its model, checked against the file itself
before a config is made from them.

A family's parser reads counts and widths from the metadata (``<arch>.block_count``,
``embedding_length``, ``attention.head_count`` ...) and the model is built from them: a
head count of 0 divides by zero, a block count of 2^31 builds layers for minutes, a key
length of 2^20 asks for gigabytes of rotary tables, all before a weight is read. Here
each is refused, in one line naming the file and the key, when it is not an integer (or
a list of them, where a file gives one per layer), is 0 where the model needs at least
one, is wider than any tensor in the file (every width a model takes is some tensor's
dimension), or, for the block count, is more layers than the file's tensors hold. The
float settings a model divides or scales by must be finite and positive.
"""

from __future__ import annotations

import math
import re
from typing import Any

# Counts and widths that some tensor of the file has as a dimension.
WIDTHS = (
    "embedding_length",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "attention.value_length",
    "attention.key_length_swa",
    "attention.value_length_swa",
    "expert_count",
    "expert_feed_forward_length",
    "expert_shared_feed_forward_length",
    "rope.dimension_count",
)
# Integers of other kinds: layers, positions, how many experts a token takes.
COUNTS = ("block_count", "context_length", "expert_used_count", "attention.sliding_window")
# At least 1 where the file gives them as one number.
AT_LEAST_ONE = ("block_count", "context_length", "embedding_length", "attention.head_count")
AT_LEAST_ONE += ("attention.head_count_kv",)
POSITIVE_FLOATS = ("attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.scaling.factor")
BLOCK = re.compile(r"blk\.(\d+)\.")
EMBEDDING = "token_embd.weight"


def check_sizes(
    file_name: str, arch: str, fields: dict[str, Any], tensors: dict[str, tuple[str, tuple]]
) -> None:
    """Refuse the first size in ``fields`` (the metadata) that ``tensors`` (name ->
    (type, shape, rows first)) cannot hold; a ``ValueError`` naming file and key."""

    def fail(key: str, what: str) -> ValueError:
        return ValueError(f"{file_name}: {arch}.{key} {what}")

    widest = max((max(shape, default=0) for _, shape in tensors.values()), default=0)
    for key in (*WIDTHS, *COUNTS):
        value = fields.get(f"{arch}.{key}")
        if value is None:
            continue
        entries = value if isinstance(value, list) else [value]
        for entry in entries:
            if not isinstance(entry, int) or isinstance(entry, bool) or entry < 0:
                raise fail(key, f"must be a non-negative integer, not {entry!r}")
        if key in AT_LEAST_ONE and not isinstance(value, list) and value < 1:
            raise fail(key, f"is {value}; the model needs at least 1")
        if key in WIDTHS and max(entries, default=0) > widest:
            raise fail(
                key,
                f"is {max(entries)}, wider than any tensor of the file (the widest "
                f"dimension is {widest})",
            )
    for key in POSITIVE_FLOATS:
        value = fields.get(f"{arch}.{key}")
        if value is not None and not _positive_number(value):
            raise fail(key, f"must be a positive finite number, not {value!r}")
    _check_layers(fail, fields.get(f"{arch}.block_count"), tensors)
    _check_embedding(file_name, fail, fields.get(f"{arch}.embedding_length"), tensors)


def _positive_number(value: Any) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )


def _check_layers(fail, blocks: int | None, tensors: dict[str, tuple[str, tuple]]) -> None:
    held = 1 + max((int(m[1]) for name in tensors if (m := BLOCK.match(name))), default=-1)
    if blocks is not None and blocks > held:
        where = f" (blk.0 to blk.{held - 1})" if held else ""
        raise fail("block_count", f"is {blocks}, but the file's tensors hold {held} layers{where}")


def _check_embedding(file_name: str, fail, width: int | None, tensors) -> None:
    if EMBEDDING not in tensors:
        raise ValueError(f"{file_name}: the file has no tensor {EMBEDDING!r} (the vocabulary)")
    shape = tensors[EMBEDDING][1]
    if len(shape) != 2 or 0 in shape:
        raise ValueError(
            f"{file_name}: tensor {EMBEDDING!r} has shape {shape} (tokens, width): it must "
            "hold at least one token of at least one value"
        )
    if width is not None and shape[1] != width:
        raise fail(
            "embedding_length",
            f"is {width}, but tensor {EMBEDDING!r} has rows of {shape[1]} values",
        )
