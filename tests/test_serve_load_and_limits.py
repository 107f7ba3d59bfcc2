"""The server under load, cancellation, overload, auth and SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import openai
import pytest

from updraft.config import EngineConfig
from updraft.demo import DEMO_DRAFT_DIR, DEMO_MODEL_DIR
from updraft.engine.engine import Engine
from updraft.runner.runner import Runner
from updraft.serve.serving import ServeSettings

from .serving import MODEL, metric, running_server, start_server_process, wait_for_idle

PROMPTS = ["def add(a, b):", "class Stack:", "import os", "for i in range(10):"]


async def stream_completion(
    client: httpx.AsyncClient, index: int, max_tokens: int, cancel: bool
) -> int | None:
    """Returns the completion token count, or None for a stream cancelled after its
    first chunk (leaving the connection closes it, which the server must notice)."""
    body = {
        "model": MODEL,
        "prompt": PROMPTS[index % len(PROMPTS)],
        "max_tokens": max_tokens,
        "temperature": 0.8,
        "seed": index,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    usage = None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if cancel:
                return None
            chunk = json.loads(line.removeprefix("data: "))
            usage = chunk["usage"] or usage
    return usage["completion_tokens"]


@pytest.mark.parametrize(
    "speculation",
    [{}, {"speculative_model": str(DEMO_DRAFT_DIR), "num_speculative_tokens": 3}],
    ids=["plain", "speculative"],
)
def test_200_concurrent_streams_with_a_quarter_cancelled_leave_nothing_behind(speculation):
    settings = ServeSettings(model_name=MODEL, max_waiting=1000)
    with running_server(settings, max_num_seqs=64, **speculation) as base_url:

        async def run_all() -> list[int | None]:
            limits = httpx.Limits(max_connections=250, max_keepalive_connections=0)
            async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=120) as client:
                jobs = [stream_completion(client, i, 12, cancel=i % 4 == 0) for i in range(200)]
                return await asyncio.gather(*jobs)

        results = asyncio.run(run_all())
        finished = [count for i, count in enumerate(results) if i % 4 != 0]
        assert len(finished) == 150 and all(count == 12 for count in finished)
        assert all(count is None for i, count in enumerate(results) if i % 4 == 0)
        wait_for_idle(base_url)
        assert metric(base_url, "updraft_num_requests_running") == 0
        assert metric(base_url, "updraft_kv_cache_used_blocks") == 0
        assert metric(base_url, "updraft_generation_tokens_total") >= 150 * 12
        aborted = metric(base_url, "updraft_request_finished_total", 'finish_reason="abort"')
        assert 0 < aborted <= 50


def test_a_client_gone_before_a_non_streamed_answer_aborts_its_request():
    with running_server() as base_url:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 1500, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{base_url}/v1/completions", json=body, timeout=0.5)
        wait_for_idle(base_url, timeout=5)  # long before 1,500 tokens could be generated
        assert metric(base_url, "updraft_generation_tokens_total") < 1500
        assert metric(base_url, "updraft_request_finished_total", 'finish_reason="abort"') == 1


def test_a_full_queue_answers_503_with_retry_after_and_recovers():
    settings = ServeSettings(model_name=MODEL, max_waiting=1)
    with running_server(settings, max_num_seqs=1) as base_url:

        async def scenario() -> httpx.Response:
            long = {"model": MODEL, "prompt": "x", "max_tokens": 400, "ignore_eos": True}
            async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
                running = asyncio.create_task(client.post("/v1/completions", json=long))
                while metric(base_url, "updraft_num_requests_running") < 1:
                    await asyncio.sleep(0.02)
                waiting = asyncio.create_task(client.post("/v1/completions", json=long))
                while metric(base_url, "updraft_num_requests_waiting") < 1:
                    await asyncio.sleep(0.02)
                refused = await client.post("/v1/completions", json={**long, "max_tokens": 2})
                for task in (running, waiting):
                    task.cancel()
                await asyncio.gather(running, waiting, return_exceptions=True)
                return refused

        refused = asyncio.run(asyncio.wait_for(scenario(), timeout=60))
        assert refused.status_code == 503
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["type"] == "service_unavailable_error"
        wait_for_idle(base_url)
        ok = httpx.post(
            f"{base_url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}
        )
        assert ok.status_code == 200


def test_an_engine_failure_is_a_503_for_everyone_and_an_unhealthy_server(monkeypatch):
    engine = Engine(EngineConfig(model=str(DEMO_MODEL_DIR)))

    def broken_forward(self, step):
        raise RuntimeError("simulated device failure")

    monkeypatch.setattr(Runner, "execute", broken_forward)
    with running_server(engine=engine) as base_url:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 4}
        for stream in (False, True):
            response = httpx.post(f"{base_url}/v1/completions", json={**body, "stream": stream})
            assert response.status_code == 503
            assert response.json()["error"]["type"] == "service_unavailable_error"
        assert httpx.get(f"{base_url}/health").status_code == 503


def test_an_api_key_guards_every_v1_route():
    with running_server(ServeSettings(model_name=MODEL, api_key="s3cret")) as base_url:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            for method, path, json_body in (
                ("POST", "/v1/completions", body),
                ("POST", "/v1/chat/completions", {"model": MODEL, "messages": []}),
                ("GET", "/v1/models", None),
            ):
                response = httpx.request(method, base_url + path, json=json_body, headers=headers)
                assert response.status_code == 401, (headers, path)
                assert response.json()["error"]["type"] == "authentication_error"
        wrong = openai.OpenAI(base_url=f"{base_url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        right = openai.OpenAI(base_url=f"{base_url}/v1", api_key="s3cret", max_retries=0)
        assert right.completions.create(**body).usage.completion_tokens == 2
        assert httpx.get(f"{base_url}/health").status_code == 200  # probes need no key


def test_sigterm_drains_the_running_stream_then_exits_zero():
    env = {name: value for name, value in os.environ.items() if name != "UPDRAFT_API_KEY"}
    process, base_url = start_server_process(env=env)
    port = int(base_url.rsplit(":", 1)[1])
    try:
        body = {"model": MODEL, "prompt": "import os", "max_tokens": 150, "ignore_eos": True}
        body.update(stream=True, stream_options={"include_usage": True})
        lines = []
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line and not lines:
                    process.send_signal(signal.SIGTERM)
                if line:
                    lines.append(line)
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2].removeprefix("data: "))["usage"]["completion_tokens"] == 150
        assert process.wait(timeout=60) == 0
        log = process.stderr.read().decode()
        assert "serving 'updraft-demo'" in log and f"on http://127.0.0.1:{port}" in log
        assert "it needs no API key" in log
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_drain_answers_503_then_cuts_streams_with_an_error_event():
    env = {name: value for name, value in os.environ.items() if name != "UPDRAFT_API_KEY"}
    process, base_url = start_server_process("--drain-timeout", "2", env=env)
    try:
        body = {"model": MODEL, "prompt": "import os", "max_tokens": 2000, "ignore_eos": True}
        lines, during = [], {}
        with httpx.stream(
            "POST", f"{base_url}/v1/completions", json={**body, "stream": True}, timeout=60
        ) as response:
            for line in response.iter_lines():
                if line and not lines:
                    process.send_signal(signal.SIGTERM)
                    time.sleep(0.3)
                    during["health"] = httpx.get(f"{base_url}/health").status_code
                    late = httpx.post(f"{base_url}/v1/completions", json=body, timeout=10)
                    during["late"] = (late.status_code, late.json()["error"]["message"])
                if line:
                    lines.append(line)
        assert during["health"] == 503
        assert during["late"][0] == 503 and "shutting down" in during["late"][1]
        assert lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2].removeprefix("data: "))["error"]
        assert "cut after the 2 s drain" in error["message"]
        assert len(lines) < 1500, "the stream ran to its end: nothing was cut"
        assert process.wait(timeout=60) == 0
        log = process.stderr.read().decode()
        assert "Traceback" not in log and "CancelledError" not in log, log
        assert "drain timeout: cutting 1 requests" in log
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
