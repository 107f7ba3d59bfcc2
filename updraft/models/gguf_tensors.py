"""A GGUF tensor's data (a numpy view of the file's copy-on-write map) as a torch
tensor, left where it lies: a float weight that the model keeps as the file stores it
(an embedding table) stays in the map rather than in a copy (one under 2 MiB, a norm, is
copied out once loaded: ``weight_memory.SMALL_MAPPED_BYTES``), and one packed into
another layout is read from there once."""

from __future__ import annotations

import warnings

import numpy as np
import torch

# The float tensor types a GGUF file may hold, as torch dtypes.
FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def float_tensor(data: np.ndarray, kind: str) -> torch.Tensor:
    """A float tensor's values over the map; gguf-py's view of a BF16 tensor is its
    bytes, which are viewed back as bfloat16."""
    tensor = block_rows(data)
    return tensor.view(torch.bfloat16) if kind == "BF16" else tensor


def block_rows(data: np.ndarray) -> torch.Tensor:
    """Rows of blocks as uint8, over the file's map itself: never written, so torch's
    warning about a read-only array is silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.asarray(data))
