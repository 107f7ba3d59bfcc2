"""Packed float32 linear layers (panels for few rows, oneDNN's packing for more) compute
what ``F.linear`` computes, and the CPU model in float32 uses them everywhere (reference
parity lives in test_reference_models; the other weight formats in
test_weight_formats)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from updraft.kernels import ops
from updraft.kernels.build import kernel_builds
from updraft.model_config import ModelConfig
from updraft.models import packed_linear
from updraft.models.loader import load_model
from updraft.models.packed_linear import PackedLinear, has_onednn
from updraft.weights import WeightFormat

pytestmark = pytest.mark.skipif(
    not (has_onednn() and kernel_builds("linear")),
    reason="needs PyTorch with oneDNN and a C compiler for the panel kernel",
)
FLOAT32 = WeightFormat("float32")


@pytest.fixture
def onednn_batches(monkeypatch):
    """float32 batches on oneDNN's packing, as on a CPU with AVX-512."""
    monkeypatch.setattr(packed_linear, "onednn_for_batches", lambda: True)


@pytest.mark.parametrize("bias", [False, True])
# Up to few_rows rows take the panel kernel (up to 6 rows at a time, so 7 and 9 rows are
# two passes; 1 and 2 rows split K in two sets, odd K leaving one over), more take oneDNN.
@pytest.mark.parametrize("rows", [(1,), (2,), (3,), (4,), (5,), (6,), (7,), (9,), (12,), (2, 3)])
@pytest.mark.parametrize("in_features", [96, 97])
# 192 outputs fill 12 panels of 16; 203 end in a partial panel.
@pytest.mark.parametrize("out_features", [192, 203])
@pytest.mark.parametrize("few_rows", [packed_linear.FEW_ROWS, packed_linear.CACHED_FEW_ROWS])
@pytest.mark.usefixtures("all_cores")
def test_packed_linear_equals_f_linear(
    bias, rows, in_features, out_features, few_rows, onednn_batches
):
    torch.manual_seed(0)
    linear = nn.Linear(in_features, out_features, bias=bias)
    x = torch.randn(*rows, in_features)
    expected = F.linear(x, linear.weight, linear.bias)
    torch.testing.assert_close(
        PackedLinear(linear, FLOAT32, few_rows)(x), expected, atol=1e-5, rtol=1e-5
    )


def test_the_panel_kernel_serves_up_to_few_rows(monkeypatch, onednn_batches):
    linear = nn.Linear(32, 40)
    calls = []
    panel_op = torch.ops.updraft.panel_linear
    monkeypatch.setattr(
        torch.ops.updraft, "panel_linear", lambda *args: calls.append(1) or panel_op(*args)
    )
    packed = PackedLinear(linear, FLOAT32, few_rows=3)
    for rows in range(1, 6):
        packed(torch.randn(rows, 32))
    assert len(calls) == 3


def test_with_avx2_alone_the_panel_kernel_serves_every_row_count(monkeypatch):
    """One copy of the weights: no oneDNN packing, and the panels take every batch."""
    assert not packed_linear.onednn_for_batches("AVX2")
    assert packed_linear.onednn_for_batches("AVX512") == has_onednn()
    assert packed_linear.onednn_for_batches("DEFAULT") == has_onednn()
    monkeypatch.setattr(packed_linear, "onednn_for_batches", lambda: False)
    linear = nn.Linear(32, 40)
    packed = PackedLinear(linear, FLOAT32, few_rows=3)
    assert packed.packed_weight is None
    for rows in (1, 5, 64, 300):
        x = torch.randn(rows, 32)
        torch.testing.assert_close(packed(x), F.linear(x, linear.weight, linear.bias))


def test_the_cpu_model_in_float32_runs_every_projection_prepacked(tiny_llama):
    config = ModelConfig.from_dir(tiny_llama)
    model = load_model(config, tiny_llama, torch.float32)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    # qkv, o, gate_up and down in each of 2 layers, and the LM head
    assert sum(isinstance(m, PackedLinear) for m in model.modules()) == 2 * 4 + 1
    half = load_model(config, tiny_llama, torch.bfloat16)
    assert not any(isinstance(m, PackedLinear) for m in half.modules())


def test_a_model_that_fits_in_cache_keeps_more_rows_on_the_plain_kernel(monkeypatch):
    def prepacked(in_features):
        model = nn.Sequential(nn.Linear(in_features, 64), nn.Linear(64, in_features))
        packed_linear.pack_linears(model, FLOAT32)
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


def test_a_bfloat16_linear_runs_batches_in_bfloat16_products_unless_kept_exact():
    """Its batches in bfloat16 products (exact where the CPU has none), or in an exact
    format (``--activations float32``), exact everywhere; no other format changes."""
    linear, bfloat16 = nn.Linear(32, 40), WeightFormat("bfloat16")
    assert PackedLinear(linear, bfloat16).code == ops.BF16_PRODUCTS
    assert PackedLinear(linear, WeightFormat("float16")).code == 2
    assert PackedLinear(linear, WeightFormat("bfloat16", exact=True)).code == 1
    assert PackedLinear(linear, WeightFormat("float16", exact=True)).code == 2
