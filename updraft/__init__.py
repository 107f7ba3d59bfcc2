"""updraft: an LLM inference engine with a paged KV cache and continuous batching."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from updraft.engine.llm import LLM
    from updraft.engine.workers import WorkerPool
    from updraft.outputs import CompletionOutput, RequestOutput
    from updraft.sampling_params import SamplingParams
    from updraft.structured_outputs import StructuredOutputsParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "WorkerPool",
]
__version__ = "0.1.0"

# Loaded on first use, so that importing a leaf module (``updraft.request``, say) does
# not load the whole engine.
_EXPORTS = {
    "LLM": "updraft.engine.llm",
    "CompletionOutput": "updraft.outputs",
    "RequestOutput": "updraft.outputs",
    "SamplingParams": "updraft.sampling_params",
    "StructuredOutputsParams": "updraft.structured_outputs",
    "WorkerPool": "updraft.engine.workers",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'updraft' has no attribute {name!r}")
    import importlib

    if name in ("LLM", "WorkerPool"):  # an engine: its kernels build beside torch's import
        from updraft.c_builds import ENGINE_KERNELS, prebuild

        prebuild(ENGINE_KERNELS)
    return getattr(importlib.import_module(_EXPORTS[name]), name)
