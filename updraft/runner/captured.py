"""Captured steps: one ``UpdatableGraph`` per bucket of uniform batches.

A bucket is (requests, query length): decode steps have query length 1, speculative
verify steps 1 + k. All buckets share one set of static input buffers, allocated at the
largest shape; a bucket reads their first rows. A step of ``n`` requests that all have
query length ``q`` replays the smallest captured bucket ``(b >= n, q)``, padded by
``pad_step``; any other step runs eagerly.
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

Bucket = tuple[int, int]  # (requests, query length of each)


class CapturedSteps:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        block_size: int,
        max_blocks_per_request: int,
        sizes: list[int],
        device: torch.device,
        query_lens: tuple[int, ...] = (1,),
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.sizes = sorted(set(sizes))
        self.query_lens = tuple(sorted(set(query_lens)))
        largest = self.sizes[-1]
        most_tokens = largest * self.query_lens[-1]

        def buffer(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.long, device=device)

        self.buffers = {
            "input_ids": (buffer(most_tokens), PAD_TOKEN_ID, lambda s: s.input_ids),
            "positions": (buffer(most_tokens), PAD_POSITION, lambda s: s.positions),
            "slot_mapping": (buffer(most_tokens), PAD_SLOT, lambda s: s.slot_mapping),
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
        self.graphs: dict[Bucket, tuple[UpdatableGraph, torch.Tensor]] = {}
        buckets = [(size, q) for q in self.query_lens for size in self.sizes]
        with torch.inference_mode():
            # Most tokens first, as a device memory pool wants.
            for bucket in sorted(buckets, key=lambda b: b[0] * b[1], reverse=True):
                self.graphs[bucket] = self._capture(*bucket)

    def bucket_for(self, step: Step) -> Bucket | None:
        query_len = step.query_lens[0]
        if (
            query_len not in self.query_lens
            or step.num_reqs > self.sizes[-1]
            or any(n != query_len for n in step.query_lens)
        ):
            return None
        return next(size for size in self.sizes if size >= step.num_reqs), query_len

    def why_not(self, step: Step) -> str:
        """Why ``bucket_for(step)`` is None, for the runner's step counts."""
        if step.num_reqs > self.sizes[-1]:
            return "batch above the largest capture size"
        if not any(step.num_drafts):
            return "prefill"
        if any(n != step.query_lens[0] for n in step.query_lens):
            return "mixed query lengths"
        return f"query length {step.query_lens[0]} not captured"

    def run(self, step: Step, bucket: Bucket) -> torch.Tensor:
        """Logits [num_tokens, vocab] of every token of the step, by replay."""
        graph, logits = self.graphs[bucket]
        size, query_len = bucket
        graph.replay(pad_step(step, size * query_len, size))
        return logits[: step.num_tokens].clone()

    def _capture(self, size: int, query_len: int) -> tuple[UpdatableGraph, torch.Tensor]:
        rows = {"input_ids": size * query_len, "positions": size * query_len}
        rows |= {"slot_mapping": size * query_len, "query_start_loc": size + 1}
        inputs = {
            name: StaticInput(name, tensor[: rows.get(name, size)], fill, pad)
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
        dummy = capture_step(size, query_len, self.block_size)

        def forward() -> torch.Tensor:
            hidden = self.model(
                inputs["input_ids"].buffer,
                inputs["positions"].buffer,
                self.kv_caches,
                metadata(dummy),
            )
            return self.model.compute_logits(hidden)

        return graph, graph.capture(forward, dummy)


def capture_step(size: int, query_len: int, block_size: int) -> Step:
    """``size`` requests of ``query_len`` tokens from position 0 that write nothing
    (slot -1): capture is quick and touches no live KV."""
    num_tokens = size * query_len
    return Step(
        request_ids=[f"capture-{i}" for i in range(size)],
        input_ids=torch.zeros(num_tokens, dtype=torch.long),
        positions=torch.arange(query_len).repeat(size),
        query_start_loc=list(range(0, num_tokens + 1, query_len)),
        query_lens=[query_len] * size,
        seq_lens=[query_len] * size,
        block_table=torch.zeros(size, -(-query_len // block_size), dtype=torch.long),
        slot_mapping=torch.full((num_tokens,), PAD_SLOT, dtype=torch.long),
        logits_indices=torch.arange(num_tokens),
        num_decodes=size if query_len == 1 else 0,
        sampling=None,
    )
