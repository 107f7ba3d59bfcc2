"""When a request stops, checked after each token it appends."""

from __future__ import annotations

from updraft.request import FinishReason, Request


def stop_condition(request: Request, token_id: int, max_model_len: int) -> FinishReason | None:
    """Feed the newly appended ``token_id`` to the request's detokenizer and say whether
    the request ends here; a stop sets ``request.stop_reason`` to what matched (None for
    EOS, the token id, or the stop string)."""
    params = request.sampling_params
    # Before min_tokens nothing stops a request but its length (as vLLM: the EOS and
    # stop tokens are masked then, and stop strings are not looked for).
    early = request.num_output_tokens < params.min_tokens
    stop_token = not early and (
        token_id in request.eos_token_ids or token_id in params.stop_token_set
    )
    # As vLLM: a token that stops the request adds no text (a spelled EOS would end
    # every reply with skip_special_tokens false), unless the stop is asked for.
    spelled = not stop_token or params.include_stop_str_in_output
    stop_string = find_stop_string(request, token_id) if spelled else None
    if not stop_token and stop_string is None:
        too_long = request.num_output_tokens >= params.max_tokens
        return FinishReason.LENGTH if too_long or request.num_tokens >= max_model_len else None
    if token_id in request.eos_token_ids:
        request.stop_reason = None
    elif token_id in params.stop_token_set:
        request.stop_reason = token_id
    else:
        request.stop_reason = stop_string
    return FinishReason.STOP


def find_stop_string(request: Request, token_id: int) -> str | None:
    """Feed the newly appended ``token_id`` to the request's detokenizer; returns the
    stop string its text now contains, if any (none is looked for before min_tokens)."""
    early = request.num_output_tokens < request.sampling_params.min_tokens
    return request.detokenizer.add(token_id, find_stops=not early)
