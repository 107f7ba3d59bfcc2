"""Frozen calls: a wrapper of allocations and kernel calls, shaped as inductor writes
them, is recorded without running (each argument named by where it comes from) and
replays as its kernels bound to those arguments; any other wrapper is left as it is."""

from __future__ import annotations

import json

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
        "reinterpret_tensor": lambda base, size, stride, offset: base.as_strided(
            size, stride, base.storage_offset() + offset
        ),
        "cpp_fused_double": cpp_fused_double,
        "cpp_fused_add": cpp_fused_add,
    }
    source = WRAPPER.replace("SIZE", str(size))
    if extra:
        source = source.replace("    del arg0_1", f"    {extra}\n    del arg0_1")
    exec(source, names)
    return names["call"], allocated


def test_a_plain_wrapper_replays_as_its_kernels_over_kept_buffers():
    call, allocated = wrapper(8)
    inputs = [torch.randn(8), torch.zeros(8)]
    run = frozen_calls.record(call, inputs)
    # Recorded without running a kernel or the wrapper's own allocations.
    assert run is not None and not allocated and not inputs[1].any()
    assert [call.arguments for call in run.calls] == [
        [["input", 0], ["buffer", 0]],
        [["buffer", 0], ["input", 0], ["input", 1]],
    ]
    assert run.buffers == [frozen_calls.Buffer([8], [1], "torch.float32")]
    assert json.loads(json.dumps(run.calls[1].arguments)) == run.calls[1].arguments
    bound = frozen_calls.bind(run, inputs)
    bound()
    torch.testing.assert_close(inputs[1], inputs[0] * 3)
    inputs[0].copy_(torch.randn(8))  # refreshed in place, as a replay's inputs are
    bound()
    torch.testing.assert_close(inputs[1], inputs[0] * 3)


def test_views_of_buffers_and_inputs_are_named_by_their_base():
    view = "reinterpret_tensor(buf0, (4,), (2,), 1)"
    call, _ = wrapper(
        8, extra=f"cpp_fused_double({view}, reinterpret_tensor(arg1_1, (4,), (1,), 4))"
    )
    inputs = [torch.randn(8), torch.zeros(8)]
    run = frozen_calls.record(call, inputs)
    assert run.calls[2].arguments == [
        ["view", ["buffer", 0], [4], [2], 1],
        ["view", ["input", 1], [4], [1], 4],
    ]
    frozen_calls.bind(run, inputs)()
    tripled = inputs[0] * 3
    torch.testing.assert_close(inputs[1][:4], tripled[:4])
    torch.testing.assert_close(inputs[1][4:], 2 * (2 * inputs[0][1::2]))


def test_a_wrapper_that_does_more_is_not_recorded():
    call, allocated = wrapper(8, extra="torch.ops.aten.relu_(arg1_1)")
    assert not frozen_calls.plain_wrapper(call)
    assert frozen_calls.record(call, [torch.randn(8), torch.empty(8)]) is None
    assert not allocated  # refused from its code, without running it


def test_a_run_whose_buffers_are_too_large_to_keep_makes_them_at_each_call(monkeypatch):
    size = frozen_calls.MAX_KEPT_BYTES // 4 + 1
    call, _ = wrapper(size)
    inputs = [torch.randn(size), torch.empty(size)]
    run = frozen_calls.record(call, inputs)
    assert run.kept_bytes() > frozen_calls.MAX_KEPT_BYTES
    bound = frozen_calls.bind(run, inputs)
    made = []
    empty_strided = torch.empty_strided

    def counted(*args, **kwargs):
        made.append(args[0])
        return empty_strided(*args, **kwargs)

    monkeypatch.setattr(torch, "empty_strided", counted)
    for _ in range(2):
        inputs[0].copy_(torch.randn(size))
        bound()
        torch.testing.assert_close(inputs[1], inputs[0] * 3)
    assert made == [[size], [size]]
