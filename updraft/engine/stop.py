"""When a request stops, checked after each token it appends."""

from __future__ import annotations

from updraft.request import FinishReason, Request


def stop_condition(request: Request, token_id: int, max_model_len: int) -> FinishReason | None:
    """Feed the newly appended ``token_id`` to the request's detokenizer and say whether
    the request ends here; a stop sets ``request.stop_reason`` to what matched (None for
    EOS, the token id, or the stop string)."""
    params = request.sampling_params
    stop_string = request.detokenizer.add(token_id)
    if token_id in request.eos_token_ids:
        request.stop_reason = None
    elif token_id in params.stop_token_set:
        request.stop_reason = token_id
    elif stop_string is not None:
        request.stop_reason = stop_string
    elif request.num_output_tokens >= params.max_tokens or request.num_tokens >= max_model_len:
        return FinishReason.LENGTH
    else:
        return None
    return FinishReason.STOP
