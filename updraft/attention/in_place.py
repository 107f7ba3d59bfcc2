"""When attention reads the paged cache in place, through updraft's CPU decode kernel."""

from __future__ import annotations

import torch

from updraft.kernels.build import kernel_builds

# Groups whose longest query is at most this many tokens (decodes, and verify steps of
# up to 7 drafts) read the cache in place, one pass over the context per query token.
# Longer queries (prefill chunks) do better as one padded matrix product per request.
IN_PLACE_MAX_QUERY = 8


def reads_cache_in_place(query: torch.Tensor) -> bool:
    """Whether the kernel serves ``query``: float32 on the CPU, where it builds."""
    return (
        query.dtype == torch.float32
        and query.device.type == "cpu"
        and kernel_builds("paged_attention")
    )
