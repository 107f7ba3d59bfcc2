"""A served demo model on a free loopback port, in a background thread of the test."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from updraft.config import EngineConfig
from updraft.demo import DEMO_MODEL_DIR
from updraft.engine.engine import Engine
from updraft.serve.server import make_server
from updraft.serve.serving import ServeSettings

MODEL = "updraft-demo"


@contextmanager
def running_server(
    settings: ServeSettings | None = None, engine: Engine | None = None, **engine_args
) -> Iterator[str]:
    """Yields the server's base URL; stops it (draining like SIGTERM) on exit."""
    settings = settings or ServeSettings(model_name=MODEL)
    engine = engine or Engine(EngineConfig(model=str(DEMO_MODEL_DIR), **engine_args))
    server = make_server(engine, settings, log_level="warning")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))  # the OS picks a free port; no race to reuse it
    port = listener.getsockname()[1]
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(60)
        listener.close()


def loads_torch(pid: int) -> bool:
    """Whether process ``pid`` has torch's libraries mapped: it imported torch."""
    return "/torch/lib/" in Path(f"/proc/{pid}/maps").read_text()


def metric(base_url: str, name: str, label: str = "") -> float:
    """The value of the first sample of /metrics named ``name`` whose labels contain
    ``label`` (e.g. 'finish_reason="abort"'); 0 when there is none yet."""
    for line in httpx.get(f"{base_url}/metrics").text.splitlines():
        if line.startswith(name + "{") and label in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def wait_for_idle(base_url: str, timeout: float = 30.0) -> None:
    """Until no request runs or waits and no KV block is used."""
    deadline = time.monotonic() + timeout
    names = (
        "updraft_num_requests_running",
        "updraft_num_requests_waiting",
        "updraft_kv_cache_used_blocks",
    )
    while True:
        values = {name: metric(base_url, name) for name in names}
        if not any(values.values()):
            return
        assert time.monotonic() < deadline, f"server still busy: {values}"
        time.sleep(0.05)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server_process(*args: str, **popen_args) -> tuple[subprocess.Popen, str]:
    """``updraft serve`` in a child process on a free port, its stderr piped; returns
    once /health answers, with the process and the base URL."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "updraft", "serve", "--port", str(port), *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        **popen_args,
    )
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert process.poll() is None, process.stderr.read().decode()
        try:
            if httpx.get(f"{base_url}/health").status_code == 200:
                return process, base_url
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.1)


def completion_texts(base_url: str, body: dict) -> tuple[str, str]:
    """(plain text, streamed text) of one completion, once the server is idle again."""
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    plain = response.json()
    streamed = []
    with httpx.stream(
        "POST", f"{base_url}/v1/completions", json={**body, "stream": True}, timeout=120
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                streamed.append(json.loads(line.removeprefix("data: "))["choices"][0]["text"])
    wait_for_idle(base_url)
    return plain["choices"][0]["text"], "".join(streamed)
