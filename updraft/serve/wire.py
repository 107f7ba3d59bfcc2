"""What the API processes and the engine core send each other, packed with msgpack.

Why msgpack and not pickle: a message is lists, numbers and strings, decoded without
running any code, so whoever can reach the socket cannot make either process run theirs;
and it packs a step's outputs for a hundred requests in tens of microseconds.

API process -> engine core (one PULL socket, every API process pushes to it):
    ["add", client, request_id, prompt token ids, sampling params, bad words' token ids]
    ["abort", client, request ids]
    ["stop", [[request id, sequence index], ...]]   (a stop string ended these sequences)
    ["hello", client]                                (an API process has started)
    ["shutdown"]
Supervising process -> engine core (on the same socket):
    ["client_gone", client]                          (that API process died)
Engine core -> one API process (a PULL socket of its own; the core pushes):
    ["step", outputs, CoreStats, request ids applied, aborts applied]
    ["failed", message]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import msgpack
import zmq

from updraft.engine.input_processor import EngineRequest
from updraft.outputs import RequestOutput, SpeculativeMetrics
from updraft.sampling_params import SamplingParams
from updraft.structured_outputs import StructuredOutputsParams


class CoreStats(NamedTuple):
    """What the API processes need of the engine's state: admission control and metrics."""

    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    drafts_proposed: list[int] = []  # noqa: RUF012 (never mutated; a NamedTuple default)
    drafts_accepted: list[int] = []  # noqa: RUF012


class SequenceDelta(NamedTuple):
    """One engine output of one sequence: what is new since its previous one. The engine
    does not decode text for served requests; the API process does (serve/outputs.py)."""

    request_id: str
    index: int
    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    stop_reason: int | None
    error: str | None
    # Sent with the sequence's first output that has tokens or ends it.
    prompt_logprobs: list[dict[int, float] | None] | None
    first_token_time: float | None
    finish_time: float | None
    num_preemptions: int
    speculative: tuple[list[int], list[int], list[int], int, int] | None


def push_socket(context: zmq.Context, address: str) -> zmq.Socket:
    """A socket that sends to ``address`` without ever blocking (no high-water mark) and
    drops what is unsent when closed."""
    socket = context.socket(zmq.PUSH)
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address)
    return socket


def pull_socket(context: zmq.Context, address: str) -> zmq.Socket:
    """A socket bound at ``address`` that receives from every sender, without a bound."""
    socket = context.socket(zmq.PULL)
    socket.setsockopt(zmq.RCVHWM, 0)
    socket.bind(address)
    return socket


def pack(message: Sequence[Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(data: bytes) -> list[Any]:
    # Integer keys: logit_bias and the top-logprob maps are keyed by token id.
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def params_to_wire(params: SamplingParams) -> dict[str, Any]:
    fields = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
    spec = params.structured_outputs
    if spec is not None:
        fields["structured_outputs"] = {
            f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)
        }
    return fields


def params_from_wire(fields: dict[str, Any]) -> SamplingParams:
    spec = fields.get("structured_outputs")
    if spec is not None:
        fields = {**fields, "structured_outputs": StructuredOutputsParams(**spec)}
    return SamplingParams(**fields)


def request_to_wire(request: EngineRequest) -> list[Any]:
    """A request through intake, as the fields of an "add" after its id."""
    return [request.prompt_token_ids, params_to_wire(request.params), request.bad_words_token_ids]


def request_from_wire(
    token_ids: list[int], fields: dict[str, Any], bad_words: list[list[int]]
) -> EngineRequest:
    """An added request as the engine queues it: the API process's intake checked it."""
    words = tuple(tuple(word) for word in bad_words)
    return EngineRequest(None, token_ids, params_from_wire(fields), words)


def delta_of(output: RequestOutput, send_prompt_logprobs: bool) -> SequenceDelta:
    completion = output.outputs[0]
    metrics = output.metrics
    speculative = metrics.speculative
    return SequenceDelta(
        output.request_id,
        completion.index,
        completion.delta_token_ids,
        completion.delta_logprobs,
        completion.delta_top_logprobs,
        completion.finish_reason,
        completion.stop_reason if isinstance(completion.stop_reason, int) else None,
        output.error,
        output.prompt_logprobs if send_prompt_logprobs else None,
        metrics.first_token_time,
        metrics.finish_time,
        metrics.num_preemptions,
        None
        if speculative is None
        else (
            speculative.proposed,
            speculative.accepted,
            speculative.reached,
            speculative.rounds,
            speculative.emitted,
        ),
    )


def speculative_from_wire(
    fields: tuple[list[int], list[int], list[int], int, int] | None,
) -> SpeculativeMetrics | None:
    return None if fields is None else SpeculativeMetrics(*fields)
