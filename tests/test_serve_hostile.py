"""The server against careless and hostile clients: each test is one way a client could
hurt the server or another client, and what must happen instead."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from updraft.serve.serving import ServeSettings

from .serving import MODEL, running_server, wait_for_idle


@pytest.fixture(scope="module")
def base_url():
    with running_server(ServeSettings(model_name=MODEL, max_tokens_limit=256)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def post(base_url: str, path: str, body: str | dict, **kwargs) -> httpx.Response:
    if isinstance(body, str):  # raw JSON text, for what a dict cannot express
        headers = {"content-type": "application/json"}
        return httpx.post(f"{base_url}{path}", content=body, headers=headers, **kwargs)
    return httpx.post(f"{base_url}{path}", json=body, **kwargs)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", '{"model": "%s", "prompt": "ab\\ud800c"}'),
        ("/v1/completions", '{"model": "%s", "prompt": "x", "stop": ["\\udfff"]}'),
        (
            "/v1/chat/completions",
            '{"model": "%s", "messages": [{"role": "user", "content": "\\ud800"}]}',
        ),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_the_field(base_url, path, body):
    response = post(base_url, path, body % MODEL)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "lone surrogate" in error["message"]
    assert error["param"] in ("prompt", "stop", "messages")


def test_the_sdk_chat_stream_helper_round_trips(client):
    messages = [{"role": "user", "content": "Sort a list."}]
    args = dict(model=MODEL, messages=messages, max_tokens=64, temperature=0, stop=["\n"])
    with client.chat.completions.stream(**args) as stream:
        kinds = {event.type for event in stream}
        final = stream.get_final_completion()
    plain = client.chat.completions.create(**args)
    assert {"chunk", "content.delta", "content.done"} <= kinds
    assert final.choices[0].message.content == plain.choices[0].message.content
    assert final.choices[0].finish_reason == "stop"


def test_raw_chat_chunks_carry_every_field_of_the_schema(base_url):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: {")]
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines]
    for chunk in chunks:
        assert chunk["object"] == "chat.completion.chunk"
        assert {"id", "created", "model", "choices"} <= set(chunk)
        for choice in chunk["choices"]:
            assert choice["index"] == 0 and "delta" in choice and "finish_reason" in choice
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    wait_for_idle(base_url)
