"""A GGUF vocabulary's arrays and special ids, checked to be what they say before a
tokenizer is built from them.

The tokens must be strings, the token types and scores numbers, the merges strings; a
special id (``tokenizer.ggml.<name>_token_id``) must be an integer. An id outside the
vocabulary is dropped with a warning, as llama.cpp drops it (the file still loads).
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

ARRAYS = (
    ("tokenizer.ggml.tokens", str, "strings"),
    ("tokenizer.ggml.merges", str, "strings"),
    ("tokenizer.ggml.token_type", int, "integers"),
    ("tokenizer.ggml.scores", int | float, "numbers"),
)


def check_vocabulary(fields: dict[str, Any]) -> None:
    """A ``ValueError`` naming the first key whose value is of the wrong kind."""
    for key, kind, plural in ARRAYS:
        value = fields.get(key)
        if value is None:
            continue
        if not isinstance(value, list):
            raise ValueError(f"{key} must be a list of {plural}, not {type(value).__name__}")
        wrong = next((item for item in value if not isinstance(item, kind)), None)
        if wrong is not None or any(isinstance(item, bool) for item in value):
            raise ValueError(f"{key} must be a list of {plural}; it holds {wrong!r}")
    for key, value in fields.items():
        named_id = key.startswith("tokenizer.ggml.") and key.endswith("_token_id")
        if named_id and (not isinstance(value, int) or isinstance(value, bool)):
            raise ValueError(f"{key} must be an integer token id, not {value!r}")


def named_token_ids(
    file_name: str, fields: dict[str, Any], vocab_size: int, names: tuple[str, ...]
) -> dict[str, int]:
    """``{"<name>_token_id": id}`` for each of ``names`` the file gives within its
    vocabulary."""
    ids = {}
    for name in names:
        value = fields.get(f"tokenizer.ggml.{name}_token_id")
        if value is None:
            continue
        if 0 <= value < vocab_size:
            ids[f"{name}_token_id"] = value
        else:
            log.warning(
                "%s: tokenizer.ggml.%s_token_id %s is not an id of its %d tokens; ignored",
                file_name, name, value, vocab_size,
            )  # fmt: skip
    return ids
