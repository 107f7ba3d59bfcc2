"""Bound calls: a replayed graph runs updraft's kernels as C calls bound once to the
captured tensors, and each replay computes what the ops compute on the refreshed
inputs, fused runs of other ops around them or not."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.test_gguf import random_blocks
from tests.test_paged_decode_kernel import reference as attention_reference
from updraft.graph.recorded import RecordedGraph
from updraft.kernels import panels
from updraft.kernels.attention_ops import paged_decode_attention_launch
from updraft.kernels.bound_calls import bound_call
from updraft.kernels.build import kernel_builds
from updraft.kernels.gguf_ops import (
    BLOCK_TYPES,
    gguf_dequantize,
    gguf_gemm_int8_launch,
    gguf_group,
    gguf_linear_int8_launch,
    gguf_linear_launch,
)
from updraft.kernels.launch import Launch
from updraft.kernels.ops import panel_linear_launch
from updraft.weights import WeightFormat

pytestmark = pytest.mark.skipif(
    not (kernel_builds("linear") and kernel_builds("paged_attention")),
    reason="needs a C compiler to build the kernels",
)

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 64, 4, 2, 16, 4


class Step(torch.nn.Module):
    """int4 panels -> attention over a paged cache -> a Q4_0 linear in GGUF blocks, with
    elementwise ops between them, over persistent inputs refreshed before each replay."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.weight = torch.randn(HEADS * HEAD_DIM, HIDDEN) / HIDDEN**0.5
        self.panels = panels.pack(self.weight, WeightFormat("int4", 32))
        self.blocks = torch.from_numpy(
            random_blocks("Q4_0", HIDDEN, HEADS * HEAD_DIM, np.random.default_rng(0))
        )
        self.cache = torch.randn(2, 16 * BLOCK, KV_HEADS, HEAD_DIM)
        self.x = torch.zeros(2, HIDDEN)
        self.block_table = torch.zeros(2, 4, dtype=torch.long)
        self.seq_lens = torch.zeros(2, dtype=torch.long)

    def forward(self) -> torch.Tensor:
        p = self.panels
        query = torch.ops.updraft.panel_linear(
            torch.tanh(self.x), p.codes, p.scales, p.zeros, None, p.code, p.group, p.out_features
        )
        attended, _ = torch.ops.updraft.paged_decode_attention(
            (query * 0.5).view(2, HEADS, HEAD_DIM),
            self.cache,
            self.block_table,
            self.seq_lens,
            BLOCK,
            HEAD_DIM**-0.5,
        )
        flat = torch.relu(attended.reshape(2, -1)) + 1
        return torch.ops.updraft.gguf_linear(flat, self.blocks, None, BLOCK_TYPES["Q4_0"], 64) * 2

    def reference(self) -> torch.Tensor:
        dequantized = panels.unpack(self.panels)
        query = torch.tanh(self.x) @ dequantized.T * 0.5
        attended = attention_reference(
            query.view(2, HEADS, HEAD_DIM),
            self.cache,
            self.block_table,
            self.seq_lens,
            BLOCK,
            HEAD_DIM**-0.5,
        )
        flat = torch.relu(attended.reshape(2, -1)) + 1
        weight = gguf_dequantize(self.blocks, BLOCK_TYPES["Q4_0"], 64)
        return flat @ weight.T * 2

    def refresh(self, generator: torch.Generator) -> None:
        self.x.copy_(torch.randn(2, HIDDEN, generator=generator))
        self.block_table.copy_(torch.randperm(16, generator=generator)[:8].view(2, 4))
        self.seq_lens.copy_(torch.randint(1, 4 * BLOCK + 1, (2,), generator=generator))


class Dispatched(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("compile_runs", [False, True], ids=["op by op", "compiled"])
@torch.inference_mode()
def test_replays_call_the_kernels_directly_on_the_refreshed_inputs(compile_runs):
    step = Step()
    graph = RecordedGraph(
        constants=[step.panels.codes, step.panels.scales, step.blocks],
        persistent=[step.cache, step.x, step.block_table, step.seq_lens],
        compile_runs=compile_runs,
    )
    out = graph.capture(step)
    launches = [call for segment in graph.segments() for call in segment]
    assert sum(isinstance(call, Launch) for call in launches) == 3
    generator = torch.Generator().manual_seed(1)
    for _ in range(4):
        step.refresh(generator)
        with Dispatched() as seen:
            graph.replay({})
        assert not [op for op in seen.ops if op.startswith("updraft.")]
        torch.testing.assert_close(out, step.reference(), atol=1e-4, rtol=1e-4)


@torch.inference_mode()
def test_an_op_on_a_copy_it_made_is_not_bound():
    """A kernel that read a contiguous copy of a strided input would re-read the copy at
    every replay, never the refreshed original: such an op goes through the dispatcher."""
    step = Step()
    p = step.panels
    strided = torch.zeros(HIDDEN, 2).t()
    args = (strided, p.codes, p.scales, p.zeros, None, p.code, p.group, p.out_features)
    out = torch.ops.updraft.panel_linear(*args)
    assert bound_call(torch.ops.updraft.panel_linear.default, args, {}, [out]) is None
    dense = torch.zeros(2, HIDDEN)
    out = torch.ops.updraft.panel_linear(dense, *args[1:])
    bound = bound_call(torch.ops.updraft.panel_linear.default, (dense, *args[1:]), {}, [out])
    assert isinstance(bound, Launch)
    dense.copy_(torch.randn(2, HIDDEN))
    bound()
    torch.testing.assert_close(out, dense @ panels.unpack(p).T, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_puts_each_row_where_index_copy_would(dtype):
    cache = torch.randn(2, 9, KV_HEADS, HEAD_DIM).to(dtype)
    fused = torch.randn(3, 3 * KV_HEADS * HEAD_DIM).to(dtype)  # a projection's output
    key, value = (part.view(3, KV_HEADS, HEAD_DIM) for part in fused.split(32, dim=1)[1:])
    assert not key.is_contiguous()  # rows a fused projection's width apart
    slots = torch.tensor([4, -1, 0])  # -1: the spare last slot
    expected = cache.clone()
    expected[0].index_copy_(0, slots.remainder(9), key)
    expected[1].index_copy_(0, slots.remainder(9), value)
    torch.ops.updraft.write_kv(cache, key, value, slots)
    assert torch.equal(cache, expected)


@torch.inference_mode()
def test_a_replayed_kv_write_takes_the_refreshed_rows_and_slots():
    cache = torch.zeros(2, 16, KV_HEADS, HEAD_DIM)
    x = torch.zeros(2, 2 * KV_HEADS * HEAD_DIM)
    slots = torch.zeros(2, dtype=torch.long)

    def step() -> None:
        key, value = torch.tanh(x).view(2, 2, KV_HEADS, HEAD_DIM).unbind(1)
        torch.ops.updraft.write_kv(cache, key, value, slots)

    graph = RecordedGraph(constants=[], persistent=[cache, x, slots], compile_runs=True)
    graph.capture(step)
    assert any(isinstance(call, Launch) for segment in graph.segments() for call in segment)
    generator = torch.Generator().manual_seed(3)
    for _ in range(3):
        x.copy_(torch.randn(x.shape, generator=generator))
        slots.copy_(torch.randperm(16, generator=generator)[:2])
        with Dispatched() as seen:
            graph.replay({})
        assert not [op for op in seen.ops if op.startswith("updraft.")]
        key, value = torch.tanh(x).view(2, 2, KV_HEADS, HEAD_DIM).unbind(1)
        assert torch.equal(cache[0, slots], key) and torch.equal(cache[1, slots], value)


@pytest.mark.usefixtures("all_cores")
def test_bound_linears_and_attention_take_torch_s_thread_count_when_they_run():
    """A linear or decode attention bound once in a captured graph leaves its thread
    count to the call (0: the caller's OpenMP count then, which torch.set_num_threads
    sets), so that a replay follows the count the engine lowers while other processes
    keep cores busy (attention fixed at two threads while the engine ran one took most
    of a decode step beside a busy neighbour). Bound under one thread and run under two, and the
    other way round, each launch gives the op's own result."""
    k, n = 256, 40
    blocks = torch.from_numpy(random_blocks("Q4_K", n, k, np.random.default_rng(5)))
    groups = gguf_group(blocks, BLOCK_TYPES["Q4_K"], k)
    p = panels.pack(torch.randn(n, k), WeightFormat("int4", 32))
    x = torch.randn(20, k, generator=torch.Generator().manual_seed(6))
    generator = torch.Generator().manual_seed(7)
    query = torch.randn(3, HEADS, HEAD_DIM, generator=generator)
    cache = torch.randn(2, 16 * BLOCK, KV_HEADS, HEAD_DIM, generator=generator)
    block_table = torch.randperm(16, generator=generator).view(4, 4)[:3]
    seq_lens = torch.tensor([5, 16, 1])
    launches = {
        "panel_linear": lambda: panel_linear_launch(
            x[:4], p.codes, p.scales, p.zeros, None, p.code, p.group, p.out_features
        ),
        "gguf_linear": lambda: gguf_linear_launch(x[:4], blocks, None, BLOCK_TYPES["Q4_K"], k),
        "gguf_linear_int8": lambda: gguf_linear_int8_launch(
            x[:4], groups, None, BLOCK_TYPES["Q4_K"], k, n
        ),
        "gguf_gemm_int8": lambda: gguf_gemm_int8_launch(x, groups, None, BLOCK_TYPES["Q4_K"], k, n),
        "paged_decode_attention": lambda: paged_decode_attention_launch(
            query, cache, block_table, seq_lens, BLOCK, HEAD_DIM**-0.5
        ),
    }
    for name, make in launches.items():
        want = make()()[0].clone()
        for bound, run in ((1, 2), (2, 1)):
            torch.set_num_threads(bound)
            launch = make()
            assert launch.arguments[-1] == 0, name
            torch.set_num_threads(run)
            torch.testing.assert_close(launch()[0], want, rtol=0, atol=0, msg=name)
