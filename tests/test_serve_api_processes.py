"""Several API processes in front of one engine (``--api-server-count 2``): they serve
one engine, /metrics from either counts the requests of both, one that is killed
mid-stream leaves nothing running in the engine while the other serves on and a new one
takes its place, and at the end nothing of the server is left.

Which API process answers is the kernel's choice; the tests choose it by stopping the
others (SIGSTOP), so that only one accepts connections."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.serving import MODEL, loads_torch, metric, start_server_process

ENV = {name: value for name, value in os.environ.items() if name != "UPDRAFT_API_KEY"}


def processes() -> dict[int, tuple[int, int]]:
    """Every live process: its parent and its process group."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, parent, group = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except OSError:
            continue
        if state != "Z":
            found[int(stat.parent.name)] = (int(parent), int(group))
    return found


def descendants(pid: int) -> set[int]:
    table, found, frontier = processes(), set(), {pid}
    while frontier:
        frontier = {child for child, (parent, _) in table.items() if parent in frontier}
        found |= frontier
    return found


def api_processes(server_pid: int) -> list[int]:
    """The server's API processes: its children that lead a process group of their own
    (the engine process stays in the server's)."""
    table = processes()
    return sorted(
        pid for pid, (parent, group) in table.items() if (parent, group) == (server_pid, pid)
    )


def metrics_directory(pid: int) -> Path:
    """Where API process ``pid`` keeps its metrics: the files it has mapped."""
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        path = Path(line.split(maxsplit=5)[-1])
        if path.name.startswith("counter_") and path.suffix == ".db":
            return path.parent
    raise AssertionError(f"API process {pid} keeps no metrics files")


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[int, str]]:
    """A server with two API processes (its pid and URL). At the end it must drain and
    exit 0, with no traceback, and neither its processes nor its sockets' directory (the
    metrics files within) may outlive it."""
    process, base_url = start_server_process("--api-server-count", "2", "--enforce-eager", env=ENV)
    try:
        ready(process.pid, base_url)
        children = descendants(process.pid)
        # The engine, two API processes, and multiprocessing's resource tracker.
        assert len(children) == 4, children
        # Only the engine loads torch: neither the API processes nor their supervisor.
        loading = {pid for pid in {process.pid, *children} if loads_torch(pid)}
        assert len(loading) == 1 and not loading & {process.pid, *api_processes(process.pid)}
        (directory,) = {metrics_directory(pid).parent for pid in api_processes(process.pid)}
        yield process.pid, base_url
        children |= descendants(process.pid)  # with an API process put back
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        log = process.stderr.read().decode()
        assert "with 2 API processes" in log and "its requests were aborted" in log, log
        assert "Traceback" not in log, log
        deadline = time.monotonic() + 10
        while children & set(processes()):
            assert time.monotonic() < deadline, "a process outlived the server"
            time.sleep(0.1)
        assert not directory.exists(), "the server left its sockets and metrics behind"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def ready(server_pid: int, base_url: str) -> None:
    """Until both API processes answer (/health answered by one says nothing of the
    other, which may still be starting)."""
    deadline = time.monotonic() + 60
    while len(api_processes(server_pid)) < 2:
        assert time.monotonic() < deadline, "the second API process did not start"
        time.sleep(0.1)
    for pid in api_processes(server_pid):
        with only(pid, server_pid):
            assert httpx.get(f"{base_url}/health", timeout=60).status_code == 200


@contextmanager
def only(pid: int, server_pid: int) -> Iterator[None]:
    """Only API process ``pid`` accepts connections: the others are stopped."""
    others = [other for other in api_processes(server_pid) if other != pid]
    for other in others:
        os.kill(other, signal.SIGSTOP)
    try:
        yield
    finally:
        for other in others:
            os.kill(other, signal.SIGCONT)


def complete(base_url: str, max_tokens: int = 4) -> str:
    body = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": max_tokens}
    body.update(temperature=0, ignore_eos=True)
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


COUNTS = {
    "finished": ("updraft_request_finished_total", 'finish_reason="length"'),
    "tokens": ("updraft_generation_tokens_total", ""),
    "latencies": ("updraft_e2e_request_latency_seconds_count", ""),
}


def counts(base_url: str) -> dict[str, float]:
    return {key: metric(base_url, name, label) for key, (name, label) in COUNTS.items()}


def test_metrics_from_either_api_process_count_the_requests_of_both(server):
    server_pid, base_url = server
    first, second = api_processes(server_pid)
    before = counts(base_url)
    texts = []
    for pid, requests in ((first, 3), (second, 2)):
        with only(pid, server_pid):
            texts += [complete(base_url) for _ in range(requests)]
    assert len(set(texts)) == 1  # greedy: whichever process answered, the same text
    for pid in (first, second):
        with only(pid, server_pid):
            after = counts(base_url)
            page = httpx.get(f"{base_url}/metrics").text
        assert after == {
            "finished": before["finished"] + 5,
            "tokens": before["tokens"] + 20,
            "latencies": before["latencies"] + 5,
        }, (pid, before, after)
        # The engine's gauges once, not once per process.
        totals = [line for line in page.splitlines() if line.startswith("updraft_kv_cache_total")]
        assert len(totals) == 1 and float(totals[0].rsplit(" ", 1)[1]) > 0, totals


def engine_busy(base_url: str) -> list[float]:
    names = ("updraft_num_requests_running", "updraft_kv_cache_used_blocks")
    return [metric(base_url, name) for name in names]


def test_a_killed_api_process_leaves_nothing_running_and_is_put_back(server):
    server_pid, base_url = server
    first, second = api_processes(server_pid)
    max_tokens = 1900  # the demo model's context is 2048
    body = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": max_tokens}
    body.update(temperature=0, ignore_eos=True, stream=True, return_token_ids=True)
    with httpx.Client(timeout=60) as http:
        with only(first, server_pid):
            request = http.build_request("POST", f"{base_url}/v1/completions", json=body)
            response = http.send(request, stream=True)
        lines, tokens, start, counted = response.iter_lines(), 0, 0.0, 0
        while tokens < 240:  # streaming from the first API process
            line = next(lines)
            if line.startswith("data: {"):
                tokens += len(json.loads(line[6:])["choices"][0]["token_ids"])
                if tokens >= 40 and not start:  # the rate past the first chunks' burst
                    start, counted = time.monotonic(), tokens
        rate = (tokens - counted) / (time.monotonic() - start)
        os.kill(first, signal.SIGKILL)
        killed = time.monotonic()
        while any(busy := engine_busy(base_url)):
            assert time.monotonic() - killed < 10, f"the engine still runs its request: {busy}"
            time.sleep(0.05)
        freed_in = time.monotonic() - killed
        # Not that it finished: left to run, it would need far longer.
        assert freed_in < 0.6 * (max_tokens - tokens) / rate, (freed_in, tokens, rate)
        response.close()
    with only(second, server_pid):
        complete(base_url)
    ready(server_pid, base_url)  # another in the killed one's place
    (new,) = set(api_processes(server_pid)) - {first, second}
    with only(new, server_pid):  # it serves: the engine sends to its place again
        complete(base_url)
