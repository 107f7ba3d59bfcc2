"""updraft: an LLM inference engine with a paged KV cache and continuous batching."""

from updraft.engine.llm import LLM
from updraft.outputs import CompletionOutput, RequestOutput
from updraft.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
