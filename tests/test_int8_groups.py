"""updraft's own int8 and int4 codes (``--quantization int8|int4``, AWQ/GPTQ W4) under int8
activations: the int8 kernel's product over their grouped blocks equals, up to float32
rounding, the float64 product of x as rounded and the weight the codes stand for
(computed here from codes, scales and zeros, not from the layout); a model loaded so
draws logits within the rounding of x of the float32-activation path, which keeps its
panels."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from tests.checkpoints import build_checkpoint
from tests.helpers import greedy, token_ids
from tests.probes import logits_of, probed, records
from tests.test_prequantized import make_quantized
from tests.test_reference_models import PROMPTS
from updraft.config import ParallelSizes
from updraft.kernels.gguf_ops import (
    gguf_group,
    gguf_linear_int8,
    gguf_round_rows,
    gguf_ungroup,
    int8_kernel_builds,
)
from updraft.kernels.int8_groups import UPDRAFT_TYPES, block_type, file_rows, row_values
from updraft.kernels.panels import pack, unpack
from updraft.model_config import ModelConfig
from updraft.models.grouped_linear import GroupedLinear, quantized_grouped
from updraft.models.loader import load_model
from updraft.models.packed_linear import PackedLinear, pack_linears
from updraft.parallel.topology import RankPlace
from updraft.weights import WeightFormat

pytestmark = pytest.mark.skipif(not int8_kernel_builds(), reason="the int8 kernel needs AVX2")


def _codes(fmt: str, n: int, k: int, group: int, generator: torch.Generator):
    """Random codes [n, k] with per row and group a scale (and int4 a zero, 0..16)."""
    groups = -(-k // group)
    scales = torch.rand(n, groups, generator=generator) * 0.1 + 1e-3
    if fmt == "int8":
        codes = torch.randint(-128, 128, (n, k), generator=generator, dtype=torch.int8)
        return codes, scales, None
    codes = torch.randint(0, 16, (n, k), generator=generator, dtype=torch.uint8)
    return codes, scales, torch.randint(0, 17, (n, groups), generator=generator).float()


def _weight(codes, scales, zeros, group: int) -> torch.Tensor:
    """What the codes stand for, in float64: scale * (code - zero) per row and group."""
    k = codes.shape[1]
    scale = scales.double().repeat_interleave(group, dim=1)[:, :k]
    zero = 0.0 if zeros is None else zeros.double().repeat_interleave(group, dim=1)[:, :k]
    return (codes.double() - zero) * scale


# fmt, K, group: blocks of 128 (types 1001, 1003) and of 32 (1000, 1002), per-row groups
LAYOUTS = [
    ("int4", 384, 128),
    ("int4", 384, 32),
    ("int4", 96, 64),
    ("int8", 384, 384),
    ("int8", 96, 96),
]


@pytest.mark.parametrize("march", ["native", "haswell"])
@pytest.mark.parametrize(
    ("fmt", "k", "group"), LAYOUTS, ids=[f"{f}-{k}-g{g}" for f, k, g in LAYOUTS]
)
@pytest.mark.usefixtures("all_cores")
def test_int8_x_times_grouped_codes_is_the_rounded_x_times_their_values(march, fmt, k, group):
    n = 37  # a last group of five rows
    generator = torch.Generator().manual_seed(k + group)
    codes, scales, zeros = _codes(fmt, n, k, group, generator)
    code = block_type(fmt, k, group)
    assert code == UPDRAFT_TYPES[fmt, 128 if k % 128 == 0 and group % 128 == 0 else 32]
    weight = _weight(codes, scales, zeros, group)
    rows = file_rows(codes, scales, zeros, group, code)
    assert torch.equal(row_values(rows, code, k), weight)
    groups = gguf_group(rows, code, k)
    assert torch.equal(gguf_ungroup(groups, code, k, n, torch.arange(n)), rows)
    bias = torch.randn(n, generator=generator)
    for count in (1, 3, 8):
        for scale in (1.0, 1e-3, 50.0):
            x = torch.randn(count, k, generator=generator) * scale
            got = gguf_linear_int8(x, groups, bias, code, k, n, march=march).double()
            rounded = gguf_round_rows(x).double()
            expected = rounded @ weight.T + bias.double()
            bound = 1e-5 * (rounded.abs() @ weight.abs().T + bias.double().abs()) + 1e-6
            assert ((got - expected).abs() <= bound).all(), (count, scale)
            # and it is not the float32 product: x was rounded
            assert not torch.allclose(got, x.double() @ weight.T + bias.double(), atol=0)


def test_blocks_are_of_128_where_every_block_lies_in_a_group_else_of_32():
    assert block_type("int4", 4096, 128) == UPDRAFT_TYPES["int4", 128]
    assert block_type("int4", 4096, 32) == UPDRAFT_TYPES["int4", 32]
    assert block_type("int4", 4096, 64) == UPDRAFT_TYPES["int4", 32]
    assert block_type("int8", 4096, 4096) == UPDRAFT_TYPES["int8", 128]
    assert block_type("int8", 4160, 4160) == UPDRAFT_TYPES["int8", 32]  # 32 * 130
    assert block_type("int8", 40, 40) is None  # x is rounded in blocks of 32
    with pytest.raises(ValueError, match=r"whole numbers 0\.\.16; these are 17\.0\.\.17\.0"):
        file_rows(
            torch.zeros(1, 32, dtype=torch.uint8),
            torch.ones(1, 1),
            torch.tensor([[17.0]]),
            32,
            1000,
        )


@pytest.mark.parametrize(
    "fmt", [WeightFormat("int8"), WeightFormat("int4", 128, True), WeightFormat("int4", 32)]
)
def test_a_quantized_linear_is_grouped_once_holding_the_panels_values(fmt):
    """The grouped weight stands for exactly the values the panels of the same format
    hold, and is the layer's only packing; a prefill's many rows (the integer GEMM)
    give row for row what a decode step computes."""
    generator = torch.Generator().manual_seed(6)
    linear = nn.Linear(256, 40)
    nn.init.normal_(linear.weight, generator=generator)
    grouped = quantized_grouped(linear, fmt)
    assert isinstance(grouped, GroupedLinear)
    assert [name for name, _ in grouped.named_buffers()] == ["groups"]
    rows = gguf_ungroup(grouped.groups, grouped.code, 256, 40, torch.arange(40))
    assert torch.equal(
        row_values(rows, grouped.code, 256).float(), unpack(pack(linear.weight, fmt))
    )
    x = torch.randn(20, 256, generator=generator)
    torch.testing.assert_close(
        grouped(x), torch.cat([grouped(row[None]) for row in x]), rtol=0, atol=0
    )


def test_a_linear_whose_columns_are_not_blocks_of_32_keeps_its_panels():
    model = nn.Sequential(nn.Linear(40, 16), nn.Linear(16 * 4, 8))
    pack_linears(model, WeightFormat("int8"), int8=True)
    assert isinstance(model[0], PackedLinear) and isinstance(model[1], GroupedLinear)


# -- models --------------------------------------------------------------------------------

# Weights drawn at a quarter of the tiny checkpoints' usual scale: their activations are
# then as spread as a trained model's, not heavy-tailed enough to make x's rounding
# several times larger than it is in practice (at 0.2, up to 6% of the logits' scale).
INIT = dict(initializer_range=0.05)


def _generated(model, **args) -> tuple[list[list[int]], list[torch.Tensor], list[nn.Module]]:
    llm = probed(str(model), block_size=4, num_kv_blocks=64, **args)
    outputs = llm.generate(PROMPTS, greedy(8))
    modules = list(llm.engine._runner.model.modules())  # noqa: SLF001
    seen = records(llm)
    return token_ids(outputs), [logits_of(seen, output) for output in outputs], modules


def assert_int8_x_moves_logits_by_about_its_rounding(model, grouped: int, **args) -> None:
    """Under int8 activations ``grouped`` linears are grouped and the logits stay within
    3% of their scale of the float32-activation path's, which keeps its panels (compared
    up to the first token the two draw differently). x rounded to int8 per 32 values is
    off by up to half a step of max |x| / 127 per value, a few tenths of a percent of a
    product's scale; through two layers and the head about a percent of the logits, the
    bound of a GGUF file's grouped blocks (tests/test_gguf_int8.py). A wrong code, scale,
    zero or row moves them by their whole scale; the lower bound says x was rounded."""
    exact = _generated(model, activations="float32", **args)
    rounded = _generated(model, activations="int8", **args)
    assert sum(isinstance(m, GroupedLinear) for m in rounded[2]) == grouped
    assert not any(isinstance(m, GroupedLinear) for m in exact[2])
    quantized = [m for m in exact[2] if isinstance(m, PackedLinear) and m.format.quantized]
    assert len(quantized) == grouped and all(m.codes is not None for m in quantized)
    pairs = zip(rounded[0], exact[0], rounded[1], exact[1], strict=True)
    for tokens, exact_tokens, ours, theirs in pairs:
        drawn = zip(tokens, exact_tokens, strict=True)
        split = next((i for i, (a, b) in enumerate(drawn) if a != b), None)
        steps = slice(0, None if split is None else split + 1)
        scale = theirs.abs().max()
        difference = (ours[steps] - theirs[steps]).abs().max()
        assert 1e-4 * scale < difference <= 0.03 * scale, (difference, scale)


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """A Llama of 128 columns (blocks of 128 for groups of 128) and 2 layers."""
    return build_checkpoint("llama-wide", tmp_path_factory.mktemp("wide"), **INIT)


@pytest.mark.parametrize(
    "args",
    [
        {"quantization": "int4", "quantization_group_size": 128, "compile_graphs": False},
        {"quantization": "int8", "enforce_eager": True},
    ],
    ids=["int4-g128-graphs", "int8-eager"],
)
def test_a_model_quantized_at_load_takes_int8_x(wide, args):
    # each layer's fused q/k/v, o_proj, fused gate/up and down_proj, and the LM head
    assert_int8_x_moves_logits_by_about_its_rounding(wide, 4 * 2 + 1, **args)


def test_an_awq_checkpoint_takes_int8_x(tmp_path):
    quantized, _ = make_quantized(tmp_path, "qwen2", "awq", 32, False, **INIT)
    # each layer's four (fused) linears; the LM head stays float32
    assert_int8_x_moves_logits_by_about_its_rounding(quantized, 4 * 2, enforce_eager=True)


def test_a_tensor_parallel_rank_groups_the_shard_it_keeps(wide):
    """Each rank quantizes and groups the slice of each linear it keeps (a row-parallel
    o_proj's and down_proj's columns too, 64 and 128 per rank: whole blocks of 32), and
    rounds its slice of x in the blocks one process rounds, so the ranks' partial
    products sum to one process's up to float32 rounding (the split itself is
    tests/test_tensor_parallel.py's)."""
    fmt = WeightFormat("int4", 32, zero_point=True)
    place = RankPlace(1, ParallelSizes(tensor=2), "unconnected")
    config = ModelConfig.from_dir(wide)
    model = load_model(config, wide, torch.float32, weights=fmt, place=place, int8_activations=True)
    weights = load_file(wide / "model.safetensors")
    grouped = {n: m for n, m in model.named_modules() if isinstance(m, GroupedLinear)}
    for name, columns in (("0.self_attn.o_proj", 64), ("1.mlp.down_proj", 128)):
        (linear,) = [m for n, m in grouped.items() if f"layers.{name}" in n]
        assert (linear.in_features, linear.out_features) == (columns, 128)
        kept = weights[f"model.layers.{name}.weight"][:, columns:]  # rank 1: the second half
        rows = gguf_ungroup(linear.groups, linear.code, columns, 128, torch.arange(128))
        assert torch.equal(row_values(rows, linear.code, columns).float(), unpack(pack(kept, fmt)))
