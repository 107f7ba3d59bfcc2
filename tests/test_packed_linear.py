"""oneDNN-prepacked linear layers compute what ``F.linear`` computes, and the CPU model
in float32 uses them everywhere (reference parity lives in test_reference_models)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from updraft import LLM
from updraft.models import packed_linear
from updraft.models.packed_linear import PackedLinear, can_prepack

pytestmark = pytest.mark.skipif(
    not can_prepack(torch.device("cpu"), torch.float32), reason="needs PyTorch with oneDNN"
)


@pytest.mark.parametrize("bias", [False, True])
# Up to few_rows rows take the plain kernel (blocks of 4 rows, then single rows; 203
# outputs end in a partial tile of weight rows), more take oneDNN.
@pytest.mark.parametrize(
    "shape", [(1, 96), (2, 96), (4, 96), (7, 96), (9, 96), (12, 96), (2, 3, 96), (1, 1, 96)]
)
@pytest.mark.parametrize("out_features", [200, 203])
@pytest.mark.parametrize("few_rows", [2, 9])
def test_packed_linear_equals_f_linear(bias, shape, out_features, few_rows):
    torch.manual_seed(0)
    linear = nn.Linear(96, out_features, bias=bias)
    x = torch.randn(shape)
    expected = F.linear(x, linear.weight, linear.bias)
    torch.testing.assert_close(PackedLinear(linear, few_rows)(x), expected, atol=1e-5, rtol=1e-5)


def test_the_cpu_model_in_float32_runs_every_projection_prepacked(tiny_llama):
    model = LLM(tiny_llama, num_kv_blocks=16).engine._runner.model
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    # qkv, o, gate_up and down in each of 2 layers, and the LM head
    assert sum(isinstance(m, PackedLinear) for m in model.modules()) == 2 * 4 + 1
    half = LLM(tiny_llama, num_kv_blocks=16, dtype="bfloat16").engine._runner.model
    assert not any(isinstance(m, PackedLinear) for m in half.modules())


def test_a_model_that_fits_in_cache_keeps_more_rows_on_the_plain_kernel(monkeypatch):
    def prepacked(in_features):
        model = nn.Sequential(nn.Linear(in_features, 64), nn.Linear(64, in_features))
        packed_linear.prepack_linears(model)
        return {m.few_rows for m in model.modules() if isinstance(m, PackedLinear)}

    monkeypatch.setattr(packed_linear, "last_level_cache_bytes", lambda: 2 * 64 * 64 * 4)
    assert prepacked(64) == {packed_linear.CACHED_FEW_ROWS}
    assert prepacked(65) == {packed_linear.FEW_ROWS}


def test_the_cache_size_is_the_largest_level_linux_reports(tmp_path):
    for index, (level, size) in enumerate([(1, "48K"), (2, "2048K"), (3, "32M"), (1, "32K")]):
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "level").write_text(f"{level}\n")
        (tmp_path / f"index{index}" / "size").write_text(f"{size}\n")
    assert packed_linear.last_level_cache_bytes(tmp_path) == 32 * 2**20
    (tmp_path / "index2" / "size").write_text("unknown\n")  # unreadable: the next level
    assert packed_linear.last_level_cache_bytes.__wrapped__(tmp_path) == 2048 * 2**10
    empty = tmp_path / "none"
    empty.mkdir()
    assert packed_linear.last_level_cache_bytes(empty) == packed_linear.DEFAULT_CACHE_BYTES
