"""Captured decode steps: one ``UpdatableGraph`` per bucket of uniform decode batches.

All buckets share one set of static input buffers, allocated at the largest bucket;
bucket ``b`` reads their first ``b`` rows. A step of ``n`` decodes replays the smallest
bucket ``b >= n``, padded by ``pad_step``; any other step runs eagerly.
"""

from __future__ import annotations

import torch

from updraft.attention.metadata import AttentionMetadata
from updraft.graph.cuda import CudaGraph
from updraft.graph.recorded import RecordedGraph
from updraft.graph.static_input import StaticInput
from updraft.graph.updatable import UpdatableGraph
from updraft.runner.step import (
    PAD_BLOCK,
    PAD_POSITION,
    PAD_SEQ_LEN,
    PAD_SLOT,
    PAD_TOKEN_ID,
    Step,
    pad_step,
)

DEFAULT_CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 64)


class CapturedDecode:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        block_size: int,
        max_blocks_per_request: int,
        sizes: list[int],
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.sizes = sorted(set(sizes))
        largest = self.sizes[-1]

        def buffer(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.long, device=device)

        self.buffers = {
            "input_ids": (buffer(largest), PAD_TOKEN_ID, lambda s: s.input_ids),
            "positions": (buffer(largest), PAD_POSITION, lambda s: s.positions),
            "slot_mapping": (buffer(largest), PAD_SLOT, lambda s: s.slot_mapping),
            "block_table": (
                buffer(largest, max_blocks_per_request),
                PAD_BLOCK,
                lambda s: s.block_table,
            ),
            "seq_lens": (buffer(largest), PAD_SEQ_LEN, lambda s: torch.tensor(s.seq_lens)),
            "query_start_loc": (
                buffer(largest + 1),
                0,
                lambda s: torch.tensor(s.query_start_loc),
            ),
        }
        # CUDA buckets share one memory pool; the CPU records ops instead.
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        self.graphs: dict[int, tuple[UpdatableGraph, torch.Tensor]] = {}
        with torch.inference_mode():
            for size in reversed(self.sizes):  # largest first, as a device pool wants
                self.graphs[size] = self._capture(size)

    def bucket_for(self, step: Step) -> int | None:
        if step.num_decodes != step.num_reqs or step.num_reqs > self.sizes[-1]:
            return None
        return next(size for size in self.sizes if size >= step.num_reqs)

    def run(self, step: Step, size: int) -> torch.Tensor:
        """Logits [num_reqs, vocab] of a decode step, by replay of bucket ``size``."""
        graph, logits = self.graphs[size]
        graph.replay(pad_step(step, size, size))
        return logits[: step.num_reqs].clone()

    def _capture(self, size: int) -> tuple[UpdatableGraph, torch.Tensor]:
        inputs = {
            name: StaticInput(name, tensor[: size + (name == "query_start_loc")], fill, pad)
            for name, (tensor, pad, fill) in self.buffers.items()
        }

        def metadata(step: Step) -> AttentionMetadata:
            return AttentionMetadata.bind(
                step,
                self.block_size,
                slot_mapping=inputs["slot_mapping"].buffer,
                block_table=inputs["block_table"].buffer,
                seq_lens=inputs["seq_lens"].buffer,
                query_start_loc=inputs["query_start_loc"].buffer,
            )

        declared = dict(
            constants=[*self.model.parameters(), *self.model.buffers()],
            persistent=[*self.kv_caches, *(i.buffer for i in inputs.values())],
            module_names={id(m): name or "model" for name, m in self.model.named_modules()},
        )
        if self.pool is None:
            backend = RecordedGraph(**declared)
        else:
            backend = CudaGraph(**declared, pool=self.pool)
        graph = UpdatableGraph(backend, list(inputs.values()), metadata)
        dummy = capture_step(size)

        def forward() -> torch.Tensor:
            hidden = self.model(
                inputs["input_ids"].buffer,
                inputs["positions"].buffer,
                self.kv_caches,
                metadata(dummy),
            )
            return self.model.compute_logits(hidden)

        return graph, graph.capture(forward, dummy)


def capture_step(size: int) -> Step:
    """``size`` one-token requests at position 0 that write nothing (slot -1): capture
    is quick and touches no live KV."""
    return Step(
        request_ids=[f"capture-{i}" for i in range(size)],
        input_ids=torch.zeros(size, dtype=torch.long),
        positions=torch.zeros(size, dtype=torch.long),
        query_start_loc=list(range(size + 1)),
        query_lens=[1] * size,
        seq_lens=[1] * size,
        block_table=torch.zeros(size, 1, dtype=torch.long),
        slot_mapping=torch.full((size,), PAD_SLOT, dtype=torch.long),
        logits_indices=torch.arange(size),
        num_decodes=size,
        sampling=None,
    )
