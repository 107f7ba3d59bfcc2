"""What a checkpoint directory's safetensors files hold, read from their headers alone,
and the config.json sizes checked against it before a model is built from them.

A config.json saying 2^31 layers with two layers of weights would have the model built
(on the meta device, a Python object per layer) for minutes, and a hidden size of 2^20
would size tables before any weight is read. Every width a model takes is a dimension
of some tensor it loads, and every decoder layer has tensors named ``layers.<i>.``: a
size wider than any tensor, or more layers than the weights name, is refused by its
key. Each file's header is checked against the file's size first (its length, and
each tensor's byte range), so nothing is read or allocated past what the file holds.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# config.json keys that are some tensor's dimension, as every family names them (the
# vocabulary's only where the weights hold an embedding or a head).
WIDTHS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
)
VOCABULARY = ("embed_tokens.weight", "lm_head.weight")
MAX_HEADER = 100 * 2**20  # safetensors' own limit on a header's length


@dataclass(frozen=True)
class Held:
    layers: int  # 1 + the highest layer index the tensors name
    widest: int  # the largest dimension of any tensor
    vocabulary: bool  # whether an embedding or an LM head is among them (a draft head
    # may share its target's)


def read_header(path: Path) -> dict[str, Any]:
    """A safetensors file's header: its length and each tensor's byte range checked to
    lie in the file; a ``ValueError`` naming the file otherwise."""

    def fail(what: str) -> ValueError:
        return ValueError(f"cannot read weights file {path}: {what}")

    size = path.stat().st_size
    with path.open("rb") as file:
        start = file.read(8)
        if len(start) < 8:
            raise fail(f"not a safetensors file ({size} bytes)")
        (length,) = struct.unpack("<Q", start)
        if length > min(size - 8, MAX_HEADER):
            raise fail(f"its header claims {length} bytes; {size - 8} follow its length")
        try:
            header = json.loads(file.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise fail(f"its header is not JSON ({error})") from None
    if not isinstance(header, dict):
        raise fail("its header is not a JSON object")
    data_size = size - 8 - length
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        shape = info.get("shape") if isinstance(info, dict) else None
        valid = (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) for o in offsets)
            and isinstance(shape, list)
            and all(isinstance(d, int) and d >= 0 for d in shape)
        )
        if not valid or not 0 <= offsets[0] <= offsets[1] <= data_size:
            raise fail(
                f"tensor {name!r}'s entry {info!r} does not lie in the file's {data_size} "
                "bytes of data"
            )
    return header


def weights_held(files: list[Path]) -> Held:
    layers, widest, vocabulary = 0, 0, False
    for path in files:
        for name, info in read_header(path).items():
            if name == "__metadata__":
                continue
            widest = max(widest, *info["shape"], 0)
            match = LAYER.search(name)
            if match:
                layers = max(layers, int(match[1]) + 1)
            vocabulary = vocabulary or name.endswith(VOCABULARY)
    return Held(layers, widest, vocabulary)


def check_against_weights(path: Path, raw: dict[str, Any], held: Held) -> None:
    """Refuse the first config.json size ``held`` cannot fill (``path``: the config)."""
    layers = raw.get("num_hidden_layers")
    if _integer(layers) and layers > held.layers:
        raise ValueError(
            f"{path}: num_hidden_layers is {layers}, but the weights hold {held.layers} layers"
        )
    for key in WIDTHS if held.vocabulary else WIDTHS[1:]:
        value = raw.get(key)
        if _integer(value) and value > held.widest:
            raise ValueError(
                f"{path}: {key} is {value}, wider than any tensor of the weights (the widest "
                f"dimension is {held.widest})"
            )


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
