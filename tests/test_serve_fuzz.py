"""Malformed and odd request bodies: every answer is a 4xx JSON error or a valid
response, never a 5xx, and the server keeps serving."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from updraft.serve.serving import ServeSettings

from .serving import MODEL, running_server, wait_for_idle

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)


def mostly(plausible: st.SearchStrategy) -> st.SearchStrategy:
    """Usually a plausible value for a field, sometimes anything at all."""
    return st.one_of(plausible, plausible, plausible, json_values)


OPTIONAL_FIELDS = {
    "max_tokens": mostly(st.integers(-3, 12)),
    "temperature": mostly(st.floats(-1, 3) | st.sampled_from([0.0, 1e-30, 1e-300, 1e30])),
    "top_p": mostly(st.floats(-0.5, 1.5) | st.sampled_from([1e-30, 1.0])),
    "top_k": mostly(st.integers(-3, 5000)),
    "min_p": mostly(st.floats(-0.5, 1.5)),
    "seed": mostly(st.integers(-(2**65), 2**65)),
    "stop": mostly(st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=3)),
    "stop_token_ids": mostly(st.lists(st.integers(-3, 2**40), max_size=3)),
    "n": mostly(st.integers(-1, 3)),
    "stream": mostly(st.booleans()),
    "stream_options": mostly(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "user": mostly(st.text(max_size=8)),
    "ignore_eos": mostly(st.booleans()),
    "presence_penalty": mostly(st.floats(-3, 3)),
    "repetition_penalty": mostly(st.floats(-1, 3)),
    "logit_bias": mostly(st.dictionaries(st.text(max_size=6), st.floats(-200, 200), max_size=3)),
    "min_tokens": mostly(st.integers(-2, 20)),
    "bad_words": mostly(st.lists(st.text(max_size=4), max_size=3)),
    "allowed_token_ids": mostly(st.lists(st.integers(-3, 5000), max_size=3)),
}
COMPLETION_FIELDS = {
    "model": mostly(st.just(MODEL)),
    "prompt": mostly(st.text(max_size=30) | st.lists(st.integers(-5, 5000), max_size=5)),
}
COMPLETION_OPTIONAL = {
    "logprobs": mostly(st.integers(-1, 7)),
    "echo": mostly(st.booleans()),
    **OPTIONAL_FIELDS,
}
message = st.fixed_dictionaries(
    {"role": mostly(st.sampled_from(["user", "system", "assistant", "x"]))},
    optional={"content": mostly(st.text(max_size=20)), "name": mostly(st.text(max_size=5))},
)
CHAT_FIELDS = {
    "model": mostly(st.just(MODEL)),
    "messages": mostly(st.lists(message, max_size=3)),
}
CHAT_OPTIONAL = {
    "max_completion_tokens": mostly(st.integers(-3, 12)),
    "logprobs": mostly(st.booleans()),
    "top_logprobs": mostly(st.integers(-1, 25)),
    **OPTIONAL_FIELDS,
}


# Valid values, edges included, so that many bodies reach the engine and the sampler.
VALID_OPTIONAL = {
    "max_tokens": st.integers(1, 8),
    "temperature": st.floats(0, 3) | st.sampled_from([1e-30, 1e-300, 1e30]),
    "top_p": st.floats(1e-30, 1),
    "top_k": st.integers(-1, 2**31 - 1),
    "min_p": st.floats(0, 1),
    "seed": st.integers(-(2**63), 2**64 - 1),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=3),
    "stop_token_ids": st.lists(st.integers(0, 2**40), max_size=3),
    "stream": st.booleans(),
    "ignore_eos": st.booleans(),
    "n": st.integers(1, 3),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.01, 3),
    "logit_bias": st.dictionaries(st.integers(0, 4095).map(str), st.floats(-100, 100), max_size=4),
    "min_tokens": st.integers(0, 1),
    "bad_words": st.lists(st.text(min_size=1, max_size=3).filter(str.strip), max_size=2),
    "allowed_token_ids": st.lists(st.integers(0, 4095), min_size=1, max_size=4),
}
VALID_COMPLETION = {
    "model": st.just(MODEL),
    "prompt": st.text(min_size=1, max_size=30) | st.lists(st.integers(0, 4095), min_size=1),
}
VALID_CHAT = {
    "model": st.just(MODEL),
    "messages": st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "assistant"]), "content": st.text()}
        ),
        min_size=1,
        max_size=3,
    ),
}


def bodies(
    valid: dict, valid_optional: dict, required: dict, optional: dict
) -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.fixed_dictionaries(valid, optional=valid_optional),
        st.fixed_dictionaries(required, optional=optional),
        json_values,
    ).map(lambda body: json.dumps(body).encode()) | st.binary(max_size=64)


BODIES = {
    "/v1/completions": bodies(
        VALID_COMPLETION, VALID_OPTIONAL, COMPLETION_FIELDS, COMPLETION_OPTIONAL
    ),
    "/v1/chat/completions": bodies(VALID_CHAT, VALID_OPTIONAL, CHAT_FIELDS, CHAT_OPTIONAL),
}


@pytest.fixture(scope="module")
def base_url():
    fuzz_settings = ServeSettings(model_name=MODEL, max_tokens_limit=12)
    with running_server(fuzz_settings) as url:
        yield url


def check_answer(response: httpx.Response) -> None:
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["type"]
    elif response.headers["content-type"].startswith("text/event-stream"):
        assert response.text.rstrip().endswith("data: [DONE]")
    else:
        assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_fuzzed_bodies_never_get_a_5xx(base_url, path):
    with httpx.Client(base_url=base_url, timeout=60) as client:

        @settings(
            max_examples=150,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(body=BODIES[path])
        def one_body(body: bytes) -> None:
            response = client.post(path, content=body, headers={"content-type": "application/json"})
            check_answer(response)

        one_body()
        good = {"model": MODEL, "max_tokens": 3}
        good.update(
            {"prompt": "x"}
            if "chat" not in path
            else {"messages": [{"role": "user", "content": "x"}]}
        )
        response = client.post(path, json=good)
        assert response.status_code == 200
        assert response.json()["usage"]["completion_tokens"] == 3
    wait_for_idle(base_url)
