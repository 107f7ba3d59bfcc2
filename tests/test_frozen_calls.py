"""Frozen calls: a wrapper of allocations and kernel calls, shaped as inductor writes
them, replays as its kernels bound to the arguments they got once; any other wrapper,
or one whose buffers are too large to keep, is left as it is."""

from __future__ import annotations

import torch

from updraft.graph import frozen_calls

WRAPPER = """
def call(args):
    arg0_1, arg1_1 = args
    args.clear()
    buf0 = empty_strided_cpu((SIZE,), (1,), torch.float32)
    cpp_fused_double(arg0_1, buf0)
    cpp_fused_add(buf0, arg0_1, arg1_1)
    del arg0_1
    del arg1_1
    return ()
"""


def wrapper(size: int, extra: str = "") -> tuple:
    """Inductor's ``call`` for ``out = 2 x + x`` over ``size`` floats, through a buffer;
    with ``extra``, one more line in it. Also the buffers it allocated."""
    allocated: list[torch.Tensor] = []

    def empty_strided_cpu(shape, stride, dtype):
        allocated.append(torch.empty_strided(shape, stride, dtype=dtype))
        return allocated[-1]

    def cpp_fused_double(x, out):
        torch.mul(x, 2, out=out)

    def cpp_fused_add(a, b, out):
        torch.add(a, b, out=out)

    names = {
        "torch": torch,
        "empty_strided_cpu": empty_strided_cpu,
        "cpp_fused_double": cpp_fused_double,
        "cpp_fused_add": cpp_fused_add,
    }
    source = WRAPPER.replace("SIZE", str(size))
    if extra:
        source = source.replace("    return ()", f"    {extra}\n    return ()")
    exec(source, names)
    return names["call"], allocated


def test_a_plain_wrapper_replays_as_its_kernels_over_kept_buffers():
    call, allocated = wrapper(8)
    inputs = [torch.randn(8), torch.empty(8)]
    frozen = frozen_calls.frozen_call(call, inputs)
    assert frozen is not None and len(allocated) == 1
    torch.testing.assert_close(inputs[1], inputs[0] * 3)
    inputs[0].copy_(torch.randn(8))  # refreshed in place, as a replay's inputs are
    frozen()
    frozen()
    torch.testing.assert_close(inputs[1], inputs[0] * 3)
    assert len(allocated) == 1  # the buffer of the recording call, kept


def test_a_wrapper_that_does_more_keeps_itself():
    call, allocated = wrapper(8, extra="torch.ops.aten.relu_(arg1_1)")
    assert not frozen_calls.plain_wrapper(call)
    assert frozen_calls.frozen_call(call, [torch.randn(8), torch.empty(8)]) is None
    assert not allocated  # refused from its code, without running it


def test_a_wrapper_whose_buffers_are_too_large_keeps_itself():
    size = frozen_calls.MAX_KEPT_BYTES // 4 + 1
    call, _ = wrapper(size)
    inputs = [torch.randn(size), torch.empty(size)]
    assert frozen_calls.frozen_call(call, inputs) is None
    torch.testing.assert_close(inputs[1], inputs[0] * 3)  # its one call still counts
