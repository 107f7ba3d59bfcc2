"""The server against careless and hostile clients: each test is one way a client could
hurt the server or another client, and what must happen instead."""

from __future__ import annotations

import contextlib
import itertools
import json

import httpx
import openai
import pytest

from updraft.serve.serving import ServeSettings

from .serving import MODEL, running_server, start_server_process, wait_for_idle


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


def test_a_stopped_server_releases_its_engine():
    """Servers come and go in one process (tests, embedders): a stopped one must not
    keep its engine, and with it the weights and the KV cache, alive."""
    import gc
    import weakref

    from updraft.config import EngineConfig
    from updraft.demo import DEMO_MODEL_DIR
    from updraft.engine.engine import Engine

    engine = Engine(EngineConfig(model=str(DEMO_MODEL_DIR)))
    alive = weakref.ref(engine)
    with running_server(engine=engine) as url:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
        assert httpx.post(f"{url}/v1/completions", json=body).status_code == 200
    del engine
    gc.collect()
    assert alive() is None, [type(r).__name__ for r in gc.get_referrers(alive())]


@pytest.fixture(scope="module")
def keyed_url():
    with running_server(ServeSettings(model_name=MODEL, api_key="s3cret")) as url:
        yield url


def test_the_key_is_checked_before_the_body_is_read(keyed_url):
    invalid = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": -1})
    for body in ("{not json", invalid):
        response = post(keyed_url, "/v1/completions", body)
        assert response.status_code == 401, response.text
        assert response.json()["error"]["code"] == "invalid_api_key"


def test_docs_and_schema_need_the_key_and_probes_do_not(keyed_url):
    for path in ("/docs", "/redoc", "/openapi.json", "/nowhere"):
        assert httpx.get(keyed_url + path).status_code == 401, path
    authorized = {"Authorization": "Bearer s3cret"}
    assert httpx.get(keyed_url + "/openapi.json", headers=authorized).status_code == 200
    assert httpx.get(keyed_url + "/health").status_code == 200
    assert httpx.get(keyed_url + "/metrics").status_code == 200


def test_metrics_name_the_served_model_not_its_directory(tmp_path):
    import shutil

    from updraft.demo import DEMO_MODEL_DIR
    from updraft.serve.launch import default_model_name

    model_dir = tmp_path / "private" / "my-model"
    shutil.copytree(DEMO_MODEL_DIR, model_dir)
    name = default_model_name(str(model_dir))
    assert name == "my-model"
    from updraft.config import EngineConfig
    from updraft.engine.engine import Engine

    engine = Engine(EngineConfig(model=str(model_dir)))
    with running_server(ServeSettings(model_name=name), engine=engine) as url:
        text = httpx.get(f"{url}/metrics").text
    assert 'model_name="my-model"' in text and str(tmp_path) not in text


def test_an_empty_api_key_refuses_to_start(capsys, monkeypatch):
    from updraft.cli import main

    assert main(["serve", "--api-key", ""]) == 2
    assert "API key from --api-key is empty" in capsys.readouterr().err
    monkeypatch.setenv("UPDRAFT_API_KEY", "  ")
    assert main(["serve"]) == 2
    assert "UPDRAFT_API_KEY" in capsys.readouterr().err
    with pytest.raises(ValueError, match="empty"):
        ServeSettings(model_name=MODEL, api_key="")


def test_stop_strings_are_bounded_in_number_and_length(base_url):
    body = {"model": MODEL, "prompt": "import os", "max_tokens": 4}
    for stop in (["x"] * 33, ["y" * 257], [f"s{i}" for i in range(80_000)]):
        response = post(base_url, "/v1/completions", {**body, "stop": stop})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "stop"
        assert len(response.text) < 1000  # the error quotes a short piece, not the input
    most = [chr(ord("A") + i) * 256 for i in range(32)]
    assert post(base_url, "/v1/completions", {**body, "stop": most}).status_code == 200
    too_many_ids = {**body, "stop_token_ids": list(range(257))}
    assert post(base_url, "/v1/completions", too_many_ids).status_code == 400


def test_huge_prompts_do_not_stall_a_running_stream(base_url):
    """Ten 1 MB prompts (refused unread) and two 60k-character ones (tokenized off the
    engine thread, then refused for their length) arrive while a stream runs."""
    import threading
    import time

    huge = {"model": MODEL, "prompt": "x" * 1_000_000, "max_tokens": 4}
    long = {"model": MODEL, "prompt": "def f(x):\n    return x\n" * 2_500, "max_tokens": 4}
    statuses: list[int] = []

    def send(body: dict) -> None:
        statuses.append(post(base_url, "/v1/completions", body, timeout=120).status_code)

    body = {"model": MODEL, "prompt": "import os", "max_tokens": 80, "ignore_eos": True}
    body.update(stream=True, temperature=0)
    arrivals, senders = [], []
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            arrivals.append(time.monotonic())
            if len(arrivals) == 10:
                senders = [
                    threading.Thread(target=send, args=(b,)) for b in [huge] * 10 + [long] * 2
                ]
                for sender in senders:
                    sender.start()
    for sender in senders:
        sender.join()
    assert statuses == [400] * 12
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert len(gaps) > 60 and max(gaps[10:]) < 1.0, max(gaps[10:])
    wait_for_idle(base_url)


def test_slowloris_connections_cannot_starve_the_server():
    """300 connections that send half a request and then a byte now and then, against a
    server allowed 256 open files: /health keeps answering, idle connections are
    closed, and the log grows by a line or two, not a line per connection."""
    import resource
    import socket
    import time

    def low_file_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))

    server, base_url = start_server_process("--request-timeout", "4", preexec_fn=low_file_limit)
    port = int(base_url.rsplit(":", 1)[1])
    slow: list[socket.socket] = []
    try:
        for _ in range(300):
            connection = socket.create_connection(("127.0.0.1", port))
            connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            slow.append(connection)
        answers = []
        end = time.monotonic() + 10
        while time.monotonic() < end:
            for connection in slow:  # keep trickling, as slowloris does
                with contextlib.suppress(OSError):
                    connection.send(b"X")
            answers.append(httpx.get(f"{base_url}/health", timeout=5).status_code)
            time.sleep(0.2)
        assert answers and set(answers) == {200}
        body = {"model": MODEL, "prompt": "import os", "max_tokens": 3}
        assert httpx.post(f"{base_url}/v1/completions", json=body, timeout=30).status_code == 200
    finally:
        for connection in slow:
            connection.close()
        server.terminate()
        log = server.communicate(timeout=60)[1].decode()
    assert log.count("Too many open files") <= 1, log[-3000:]
    assert log.count("WARNING") + log.count("ERROR") <= 4, log[-3000:]


def _schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


HUGE = 10**30  # past msgpack's 64 bits: it cannot reach the engine process
USER = [{"role": "user", "content": "hi"}]
TOOL_WITH_HUGE_ENUM = {
    "type": "function",
    "function": {
        "name": "f",
        "parameters": {"type": "object", "properties": {"a": {"enum": [HUGE]}}},
    },
}


@pytest.mark.parametrize(
    ("path", "body", "param", "message"),
    [
        ("/v1/completions", {"prompt": [[-1, 5]]}, "prompt", "token id -1 at position 0"),
        ("/v1/completions", {"prompt": [5, -1]}, "prompt", "token id -1 at position 1"),
        ("/v1/completions", {"prompt": [2**40]}, "prompt", "outside the vocabulary"),
        ("/v1/completions", {"prompt": [HUGE]}, "prompt", "token id 2**99 (or beyond)"),
        ("/v1/completions", {"prompt": [[1], [2.5]]}, "prompt", "2.5 at prompt[1][0] is not"),
        ("/v1/completions", {"prompt": "x", "stop_token_ids": [HUGE]}, "stop_token_ids", "2**99"),
        ("/v1/completions", {"prompt": "x", "allowed_token_ids": [1, 10**6]}, "allowed_token_ids",
         "token id 1000000 at position 1 is outside the vocabulary"),
        ("/v1/completions", {"prompt": "x", "truncate_prompt_tokens": HUGE},
         "truncate_prompt_tokens", "does not fit in 64 bits"),
        ("/v1/completions", {"prompt": "x", "response_format": _schema({"enum": [HUGE]})},
         "response_format", "2**99 (or beyond) at /enum/0 of its schema"),
        ("/v1/completions", {"prompt": "x", "guided_json": {"type": "integer", "minimum": -HUGE}},
         "guided_json", "-2**99 (or beyond) at /minimum of its schema"),
        ("/v1/chat/completions", {"messages": USER, "logit_bias": {str(HUGE): 1}}, "logit_bias",
         "key 2**99 (or beyond) is outside the vocabulary"),
        ("/v1/chat/completions", {"messages": USER, "stop_token_ids": [3, -2]}, "stop_token_ids",
         "-2"),
        ("/v1/chat/completions", {"messages": USER, "response_format": _schema({"const": HUGE})},
         "response_format", "at /const of its schema does not fit in 64 bits"),
        ("/v1/chat/completions",
         {"messages": USER, "tools": [TOOL_WITH_HUGE_ENUM], "tool_choice": "required"}, "tools",
         "does not fit in 64 bits"),
    ],
)  # fmt: skip
def test_bad_ids_and_huge_integers_are_a_400_naming_the_field(base_url, path, body, param, message):
    """Negative, out-of-vocabulary and non-integer ids, and integers the engine process
    cannot be sent (a schema's constants included), are refused before anything is
    built from them: a 400 whose param is the field, never a 500."""
    response = post(base_url, path, {"model": MODEL, "max_tokens": 2, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error
