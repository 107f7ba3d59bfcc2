"""The engine core behind the server: its outputs, decoded in the API process, are the
engine's own; in a process of its own it steps while the API process holds its GIL; and
a server's processes, sockets and files all go when it stops or its parent dies (with
several API processes: tests/test_serve_api_processes.py)."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.serving import MODEL, loads_torch, start_server_process
from updraft.config import EngineConfig
from updraft.demo import DEMO_MODEL_DIR
from updraft.engine.engine import Engine
from updraft.outputs import RequestOutput, merge_outputs
from updraft.sampling_params import SamplingParams
from updraft.serve.engine_client import CoreLink, EngineClient
from updraft.serve.engine_core import CoreThread
from updraft.serve.engine_process import CoreProcess

PROMPTS = ["def add(a, b):", "import os\nimport sys\n", "class Stack:\n    def push"]

# Each exercises what the API process now does instead of the engine: decoding, stop
# strings (alone, kept, after min_tokens, in several sequences, in multi-token steps).
CASES = {
    "stop strings": dict(max_tokens=60, temperature=0, stop=["\n\n", "return"]),
    "stop kept": dict(
        max_tokens=60, temperature=0, stop=["string"], include_stop_str_in_output=True
    ),
    "min_tokens": dict(max_tokens=40, temperature=0, stop=["e"], min_tokens=8),
    "n=2 sampled": dict(
        max_tokens=40, temperature=1.0, seed=7, n=2, stop=[" the", "\n\n"], logprobs=2
    ),
    "special tokens": dict(
        max_tokens=30, temperature=0, skip_special_tokens=False, stop=["(self"], logprobs=True
    ),
}


def _in_process(engine: Engine, prompt: list[int], params: SamplingParams) -> RequestOutput:
    latest: dict[int, RequestOutput] = {}
    request_id = engine.add_request(prompt, params)
    while engine.has_unfinished:
        for output in engine.step():
            assert output.request_id == request_id
            latest[output.outputs[0].index] = output
    return merge_outputs(list(latest.values()))


# Steps the core may still run once a stream has ended: those under way before the API
# process's "stop" (a stop string ends a sequence there) reaches it. A core that kept
# computing a stopped sequence runs on to max_tokens, tens of steps.
STEPS_AFTER_THE_STREAM = 8


async def _until_idle(client: EngineClient, timeout: float = 30.0) -> None:
    """Until the core reports no request running or waiting and no KV block used."""
    deadline = time.monotonic() + timeout
    while True:
        stats = client.stats
        if not (stats.num_running or stats.num_waiting or stats.kv_blocks_used):
            return
        assert time.monotonic() < deadline, f"the core is still busy: {stats}"
        await asyncio.sleep(0.005)


def _through_core(
    engine: Engine, prompt: list[int], params: SamplingParams
) -> tuple[RequestOutput, int]:
    """The served output, and how many steps the core ran after the stream ended before
    it was idle: checked before shutting down, since a shutdown aborts everything."""

    async def run() -> tuple[RequestOutput, int]:
        core = CoreThread(engine)
        client = EngineClient(
            CoreLink(core.addresses, 0, core.start, core.is_alive, core.join), engine.tokenizer
        )
        client.start()
        latest, deltas = {}, {}
        try:
            async for output in client.generate("r", prompt, params):
                index = output.outputs[0].index
                latest[index] = output
                deltas[index] = deltas.get(index, "") + output.outputs[0].delta_text
            steps_at_the_end = engine.stats().num_steps
            await _until_idle(client)
            steps_after = engine.stats().num_steps - steps_at_the_end
        finally:
            await client.shutdown(5)
        for index, text in deltas.items():  # the deltas add up to the whole text
            assert text == latest[index].outputs[0].text
        return merge_outputs(list(latest.values())), steps_after

    return asyncio.run(run())


def _summary(output: RequestOutput) -> list[tuple]:
    return [
        (c.text, c.token_ids, c.finish_reason, c.stop_reason, c.logprobs, c.top_logprobs)
        for c in output.outputs
    ]


@pytest.mark.parametrize("speculative", [None, "ngram"])
def test_outputs_through_the_core_are_the_engines_own(speculative):
    engine_args = dict(model=str(DEMO_MODEL_DIR))
    if speculative:  # verify steps append several tokens at once: stops fall inside them
        engine_args.update(speculative_method=speculative, num_speculative_tokens=3)
    engine = Engine(EngineConfig(**engine_args))
    stopped = 0
    for name, fields in CASES.items():
        params = SamplingParams(**fields)
        for text in PROMPTS:
            prompt = engine.tokenizer.encode(text)
            expected = _in_process(engine, prompt, params)
            served, steps_after = _through_core(engine, prompt, params)
            assert _summary(served) == _summary(expected), (name, text)
            assert steps_after <= STEPS_AFTER_THE_STREAM, (name, text, steps_after)
            assert served.outputs[0].token_ids, (name, text)
            stopped += sum(isinstance(c.stop_reason, str) for c in expected.outputs)
    assert stopped >= 8, "too few outputs ended on a stop string to show anything"
    assert engine.stats().kv_blocks_used == 0 and not engine.has_unfinished


def test_the_engine_process_steps_while_the_api_process_holds_its_gil():
    """The API process takes the GIL for two seconds (a pure-Python loop under a long
    switch interval, as a tokenizer or a JSON parser would): the engine's own clock says
    it finished a 64-token request before that loop ended."""

    async def run() -> tuple[float, float | None]:
        core = CoreProcess(EngineConfig(model=str(DEMO_MODEL_DIR), enforce_eager=True))
        info = core.start()
        client = EngineClient(CoreLink(core.addresses, 0, None, core.is_alive, core.join), None)
        client.start()
        try:
            params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
            outputs = client.generate("r", [1, 2, 3, 4], params)
            first = await anext(outputs)  # the engine has started on it
            assert len(first.outputs[0].token_ids) < 64 and info.max_model_len > 64
            interval = sys.getswitchinterval()
            sys.setswitchinterval(10.0)
            try:
                end = time.perf_counter() + 2.0
                while time.perf_counter() < end:
                    pass
                held_until = time.perf_counter()
            finally:
                sys.setswitchinterval(interval)
            last = first
            async for output in outputs:
                last = output
            assert len(last.outputs[0].token_ids) == 64
            return held_until, last.metrics.finish_time
        finally:
            await client.shutdown(5)

    held_until, finished = asyncio.run(run())
    assert finished is not None and finished < held_until, (
        "the engine stood still while the API process held the GIL"
    )


def _children(pid: int) -> set[int]:
    """Every live descendant of ``pid``."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier}
        found |= frontier
    return found


def _gone(pids: set[int], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(Path(f"/proc/{pid}").exists() for pid in pids):
            return True
        time.sleep(0.1)
    return False


ENV = {name: value for name, value in os.environ.items() if name != "UPDRAFT_API_KEY"}


@pytest.fixture
def own_tmp() -> Iterator[Path]:
    """A temporary directory of the test's own, for its servers' TMPDIR: the engine core
    makes its socket directory there, where no other test's server (in another worker)
    makes one. Short, since a socket's path may not pass 107 bytes."""
    directory = Path(tempfile.mkdtemp(prefix="ud-"))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def _env(own_tmp: Path) -> dict[str, str]:
    return {**ENV, "TMPDIR": str(own_tmp)}


def _socket_dirs(own_tmp: Path) -> set[Path]:
    """The engine cores' socket directories in the test's temporary directory."""
    return set(own_tmp.glob("updraft-core-*"))


def _complete(base_url: str, max_tokens: int = 8, **fields) -> httpx.Response:
    body = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(f"{base_url}/v1/completions", json={**body, **fields}, timeout=60)


def test_a_dead_engine_process_is_a_503_and_a_dead_server_takes_it_along(own_tmp):
    process, base_url = start_server_process("--enforce-eager", env=_env(own_tmp))
    try:
        assert _complete(base_url).status_code == 200
        # Its grammar compiles in the API process too (a 400 names a spec that cannot).
        choice = _complete(base_url, structured_outputs={"choice": ["yes", "no"]})
        assert choice.json()["choices"][0]["text"] in ("yes", "no"), choice.text
        engines = [
            pid
            for pid in _children(process.pid)
            if "multiprocessing.spawn" in Path(f"/proc/{pid}/cmdline").read_text()
        ]
        assert len(engines) == 1
        # The API process (the server's own) serves without torch: it starts beside the
        # engine process instead of loading torch before it.
        assert loads_torch(engines[0]) and not loads_torch(process.pid)
        os.kill(engines[0], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while httpx.get(f"{base_url}/health").status_code == 200:
            assert time.monotonic() < deadline, "/health still says healthy"
            time.sleep(0.1)
        response = _complete(base_url)
        assert response.status_code == 503, response.text
        assert "engine" in response.json()["error"]["message"]
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    # A server killed outright: its engine and API processes see it gone and exit.
    process, base_url = start_server_process(
        "--api-server-count", "2", "--enforce-eager", env=_env(own_tmp)
    )
    try:
        children = _children(process.pid)
        assert _complete(base_url).status_code == 200
    finally:
        process.kill()
        process.wait()
    assert len(children) == 4, children
    assert _gone(children, 10), "a process outlived its killed server"
    assert not _socket_dirs(own_tmp), "the engine's sockets were left behind"


def test_a_request_the_wire_cannot_carry_leaves_nothing_in_flight():
    """An integer past 64 bits (intake refuses it; a caller that skipped intake) fails
    the add before anything is registered, so the client holds nothing in flight and its
    shutdown does not wait on a request that never reached the core."""
    engine = Engine(EngineConfig(model=str(DEMO_MODEL_DIR), enforce_eager=True))

    async def run() -> None:
        core = CoreThread(engine)
        client = EngineClient(
            CoreLink(core.addresses, 0, core.start, core.is_alive, core.join), engine.tokenizer
        )
        client.start()
        unchecked = SamplingParams(max_tokens=2)
        object.__setattr__(unchecked, "seed", 2**70)  # as if no check had run
        try:
            with pytest.raises(OverflowError):
                async for _ in client.generate("r", [5], unchecked):
                    pass
            assert client.num_in_flight == 0
            async for _ in client.generate("s", [5, 6], SamplingParams(max_tokens=2)):
                pass
        finally:
            await client.shutdown(5)

    asyncio.run(run())
    assert engine.stats().kv_blocks_used == 0 and not engine.has_unfinished
