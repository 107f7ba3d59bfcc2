"""A GGUF tensor's data (a numpy view of the file's read-only map) as a torch tensor:
float types copied out in their own dtype, blocks left where they lie."""

from __future__ import annotations

import warnings

import numpy as np
import torch

# The float tensor types a GGUF file may hold, as torch dtypes.
FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def float_tensor(data: np.ndarray, kind: str) -> torch.Tensor:
    """A float tensor's values, copied (the map is read-only); gguf-py's view of a BF16
    tensor is its bytes, which are viewed back as bfloat16."""
    tensor = torch.from_numpy(np.array(data))
    return tensor.view(torch.bfloat16) if kind == "BF16" else tensor


def block_rows(data: np.ndarray) -> torch.Tensor:
    """Rows of blocks as uint8, over the file's map itself: never written, so torch's
    warning about a read-only array is silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.asarray(data))
