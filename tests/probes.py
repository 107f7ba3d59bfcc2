"""What tests observe of a running engine, through the documented runner probe
(``updraft/runner/probe.py``, ``EngineConfig.probe``) and ``Engine.stats()``."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from typing import Any

import torch

from updraft import LLM, RequestOutput
from updraft.runner.probe import ProbeRecords, read_probe


def probe_dir() -> str:
    """A directory for an engine's probe records, removed when the tests end."""
    directory = tempfile.mkdtemp(prefix="updraft-probe-")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return directory


def probed(model: Any, **engine_args: Any) -> LLM:
    """An LLM whose every rank records its steps (``EngineConfig.probe``)."""
    return LLM(model, probe=probe_dir(), **engine_args)


def records(llm: LLM) -> ProbeRecords:
    """Close ``llm``'s engine (every rank's records are complete once it has) and read
    what its probe recorded."""
    llm.engine.close()
    return read_probe(llm.engine.config.probe)


def logits_of(seen: ProbeRecords, output: RequestOutput) -> torch.Tensor:
    """[output tokens, vocab]: the logits each of ``output``'s tokens was drawn from
    (tokens dropped after a stop are left out)."""
    return seen.logits_of(output.request_id, len(output.outputs[0].token_ids))


def assert_idle(llm: LLM) -> None:
    """No request left, no KV block held."""
    stats = llm.engine.stats()
    assert stats.kv_blocks_used == stats.window_blocks_used == 0
    assert stats.num_running == stats.num_waiting == 0


def count_prefix_hits(monkeypatch: Any) -> list[int]:
    """The number of cached blocks each prefix lookup finds, appended as they happen."""
    from updraft.engine.kv_blocks import KVCacheManager

    hits: list[int] = []
    cached_prefix = KVCacheManager.cached_prefix

    def counted(self: KVCacheManager, request: Any) -> list:
        blocks = cached_prefix(self, request)
        hits.append(len(blocks))
        return blocks

    monkeypatch.setattr(KVCacheManager, "cached_prefix", counted)
    return hits
