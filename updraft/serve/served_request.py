"""A request as its API process sees it: the engine core sends tokens, this turns them
into the outputs the engine would have made in the same process.

Each sequence keeps a ``Request`` record (its tokens, logprobs and detokenizer) that
only this process writes. Text is decoded here, off the engine's GIL, and stop strings
are found here: a sequence a stop string ends is finished at once, its tokens past the
stop dropped, and the engine core is told to stop computing it (``ServedRequest.apply``
says which). The engine ends sequences on everything else (EOS, stop token ids,
max_tokens, the context, grammars, errors), as it would in-process.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

from updraft.engine.input_processor import EngineRequest
from updraft.engine.stop import find_stop_string
from updraft.outputs import RequestOutput, SpeculativeMetrics
from updraft.request import FinishReason, Request, RequestStatus
from updraft.serve.wire import SequenceDelta
from updraft.tokenizer import Tokenizer


class ServedRequest:
    def __init__(
        self,
        request_id: str,
        intake: EngineRequest,
        tokenizer: Tokenizer | None,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        """``intake``: the request as this process's intake made it (its checked,
        truncated prompt ids), one record per sequence; ``eos_token_ids``: the model's."""
        self.request_id = request_id
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.arrival_time = time.perf_counter()
        self.last_token_time: float | None = None
        # No seed: the record draws nothing, and a generator would cost for nothing.
        record_params = replace(intake.params, n=1, seed=None)
        eos = () if record_params.ignore_eos else eos_token_ids
        self.sequences = [
            intake.build(request_id, record_params, tokenizer, eos, self.arrival_time)
            for _ in range(intake.params.n)
        ]

    @property
    def finished(self) -> bool:
        return all(sequence.finished for sequence in self.sequences)

    def apply(self, delta: SequenceDelta) -> tuple[RequestOutput | None, bool]:
        """The output for what the engine sent of one sequence, and whether a stop
        string ended the sequence here (the engine is still computing it). None when the
        sequence had already ended here."""
        sequence = self.sequences[delta.index]
        if sequence.finished:
            return None, False
        tokens, logprobs, top = delta.token_ids, delta.logprobs, delta.top_logprobs
        stop_string = None
        for count, token_id in enumerate(tokens, start=1):
            sequence.token_ids.append(token_id)
            if logprobs is not None:
                sequence.logprobs.append(logprobs[count - 1])
            if top is not None:
                sequence.top_logprobs.append(top[count - 1])
            if count == len(delta.token_ids) and _spells_no_text(sequence, token_id, delta):
                break
            stop_string = find_stop_string(sequence, token_id)
            if stop_string is not None:
                tokens = tokens[:count]
                break
        reason, stop_reason = delta.finish_reason, delta.stop_reason
        # The engine's own stop on the same token wins (EOS or a stop token id), as in
        # the engine's stop_condition.
        stopped_here = stop_string is not None and not (
            len(tokens) == len(delta.token_ids) and reason == FinishReason.STOP
        )
        if stopped_here:
            reason, stop_reason = FinishReason.STOP, stop_string
        if delta.prompt_logprobs is not None:
            sequence.prompt_logprobs = delta.prompt_logprobs
        sequence.first_token_time = delta.first_token_time
        sequence.num_preemptions = delta.num_preemptions
        if delta.speculative is not None:
            sequence.speculative = SpeculativeMetrics(*delta.speculative)
        sequence.error = delta.error
        if reason is not None:
            sequence.status = RequestStatus.FINISHED
            sequence.finish_reason = FinishReason(reason)
            sequence.stop_reason = stop_reason
            sequence.finish_time = delta.finish_time or time.perf_counter()
        output = sequence.take_output(
            tokens,
            None if logprobs is None else logprobs[: len(tokens)],
            delta.speculative is not None,
        )
        output.outputs[0].index = delta.index
        output.finished = self.finished
        early_stop = stopped_here and delta.finish_reason is None
        return output, early_stop


def _spells_no_text(sequence: Request, token_id: int, delta: SequenceDelta) -> bool:
    """Whether ``token_id`` is the EOS or stop token the engine ended the sequence on,
    whose text stays out of the reply (as the engine's stop_condition leaves it out)."""
    params = sequence.sampling_params
    return (
        delta.finish_reason == FinishReason.STOP
        and not params.include_stop_str_in_output
        and (token_id in sequence.eos_token_ids or token_id in params.stop_token_set)
    )
