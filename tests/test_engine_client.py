"""The API side of the engine core: what counts as waiting when clients leave before the
core has seen their requests."""

from __future__ import annotations

import asyncio
import threading

from tests.helpers import greedy
from updraft.config import EngineConfig
from updraft.demo import DEMO_MODEL_DIR
from updraft.engine.engine import Engine
from updraft.serve.engine_client import CoreLink, EngineClient
from updraft.serve.engine_core import CoreThread


def test_requests_whose_clients_left_hold_no_waiting_place():
    engine = Engine(EngineConfig(model=str(DEMO_MODEL_DIR), enforce_eager=True))
    step, gate = engine.step, threading.Event()

    def gated_step():  # the core waits here: nothing it is sent gets applied
        gate.wait(30)
        return step()

    engine.step = gated_step

    async def storm() -> tuple[int, int, int, int]:
        core = CoreThread(engine)
        loop = EngineClient(
            CoreLink(core.addresses, 0, core.start, core.is_alive, core.join), engine.tokenizer
        )
        loop.start()
        busy = loop.generate("long", engine.tokenizer.encode("def f():"), greedy(200))
        first = asyncio.create_task(anext(busy))
        await asyncio.sleep(0.2)  # the core is now inside a gated step
        prompt = engine.tokenizer.encode("import os")
        clients = [loop.generate(f"c{i}", prompt, greedy(4)) for i in range(20)]
        tasks = [asyncio.create_task(anext(c)) for c in clients]
        await asyncio.sleep(0.05)
        queued = loop.num_waiting
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        left = loop.num_waiting
        gate.set()
        await first
        await busy.aclose()
        await asyncio.sleep(0.2)
        stats = engine.stats()
        await loop.shutdown(5)
        return queued, left, stats.num_waiting, stats.num_running

    queued, left, waiting, running = asyncio.run(storm())
    # The long request waits in the engine (its step is held before it schedules).
    assert queued == 1 + 20
    assert left == 1, "requests whose clients left still count as waiting"
    assert waiting == 0 and running == 0  # the abandoned adds never reached the engine
