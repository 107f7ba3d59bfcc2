"""What the server enforces on top of the engine (``ServeSettings``).

Apart from the handlers that apply it: the process that starts ``updraft serve`` makes
these settings before it starts the engine process, and loads nothing heavy until then.
"""

from __future__ import annotations

from dataclasses import dataclass

from updraft.serve.parsers.reasoning import REASONING_PARSERS
from updraft.serve.parsers.tools import PARSERS


@dataclass
class ServeSettings:
    """What the server enforces on top of the engine; see ``updraft serve --help``."""

    model_name: str
    api_key: str | None = None
    max_request_bytes: int = 1 << 20
    max_tokens_limit: int | None = None  # None: the engine's max_model_len
    max_waiting: int = 256
    drain_timeout: float = 60.0
    max_connections: int = 1024  # open at once; past it the idlest is closed
    request_timeout: float = 30.0  # seconds for a whole request to arrive
    tool_call_parser: str | None = None  # None: the one the chat template's syntax calls for
    # None: on (named as the template's family) where the chat template shows thinking;
    # "none": off.
    reasoning_parser: str | None = None
    # A grammar constrains the reasoning too, as vLLM's enable_in_reasoning does.
    structured_outputs_in_reasoning: bool = False

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("the API key is empty: it would let anyone in; use None for no key")
        if self.tool_call_parser not in (None, *PARSERS):
            raise ValueError(
                f"tool_call_parser: {self.tool_call_parser!r} is not one of {', '.join(PARSERS)}"
            )
        reasoning = (*REASONING_PARSERS, "none")
        if self.reasoning_parser not in (None, *reasoning):
            raise ValueError(
                f"reasoning_parser: {self.reasoning_parser!r} is not one of {', '.join(reasoning)}"
            )
