"""AWQ, GPTQ and compressed-tensors (pack-quantized W4A16) checkpoints, read into the int4
panels as their own codes.

Unpacking is checked against int32 words written out by hand from each published layout
(not against a packer written here). Then whole checkpoints, packed by the test in each
layout from one set of codes, give the logits transformers computes on the float32
weights those codes stand for (within 1e-4, absolute and relative), in groups of 32, 64
and 128 and per channel, symmetric and asymmetric. What cannot be read is refused by
name.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from tests.checkpoints import FAMILIES, tiny_model
from tests.helpers import greedy
from tests.probes import logits_of, probed, records
from tests.test_reference_models import PROMPTS
from updraft import LLM
from updraft.models.packed_linear import PackedLinear
from updraft.models.prequantized import unpack
from updraft.weights import QuantizedCheckpoint


def words(*values: int) -> torch.Tensor:
    """Unsigned 32-bit words as the int32 tensors checkpoints hold."""
    return torch.tensor([v - (1 << 32) if v >= 1 << 31 else v for v in values], dtype=torch.int32)


def scheme(method: str, group: int | None = 32, symmetric: bool = True, v1: bool = False):
    return QuantizedCheckpoint(method, group, symmetric, gptq_v1_zeros=v1)


# -- unpacking, against words written from the published layouts --------------------------


def test_awq_packs_columns_0_2_4_6_1_3_5_7_into_nibbles_0_to_7():
    # Word 0xFEDCBA98: nibbles 0..7 (low to high) are 8, 9, A, B, C, D, E, F, so
    # columns 0, 2, 4, 6, 1, 3, 5, 7 hold 8, 9, 10, 11, 12, 13, 14, 15.
    columns = [8, 12, 9, 13, 10, 14, 11, 15]
    qweight = words(*[0xFEDCBA98] * 32).view(32, 1)  # [K, N / 8]: every input row alike
    qzeros = words(0x76543210).view(1, 1)  # zeros 0, 4, 1, 5, 2, 6, 3, 7 by column
    zeros = [0, 4, 1, 5, 2, 6, 3, 7]
    scales = torch.full((1, 8), 0.5, dtype=torch.float16)
    got = unpack(
        scheme("awq", symmetric=False),
        {"qweight": qweight, "qzeros": qzeros, "scales": scales},
        in_features=32,
    )
    assert got.codes.tolist() == [[c] * 32 for c in columns]
    assert got.zeros.flatten().tolist() == zeros
    expected = torch.tensor([[0.5 * (c - z)] * 32 for c, z in zip(columns, zeros, strict=True)])
    assert torch.equal(got.dequantize(), expected)


def test_gptq_packs_input_rows_in_order_and_stores_zeros_minus_one():
    qweight = torch.zeros(4, 8, dtype=torch.int32)  # [K / 8, N]
    qweight[0, 0] = words(0x76543210)[0]  # rows 0..7 of column 0: 0, 1, ..., 7
    qweight[3, 7] = words(0xF0000000)[0]  # row 31 of column 7: 15
    qzeros = words(0x77777773).view(1, 1)  # stored minus one: column 0's zero 4, the rest 8
    scales = torch.full((1, 8), 2.0, dtype=torch.float16)
    got = unpack(
        scheme("gptq", symmetric=False, v1=True),
        {"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": torch.zeros(32)},
        in_features=32,
    )
    assert got.codes[0, :8].tolist() == list(range(8)) and got.codes[0, 8:].sum() == 0
    assert got.codes[7, 31] == 15 and got.codes[7, :31].sum() == 0
    assert got.zeros.flatten().tolist() == [4] + [8] * 7
    assert got.dequantize()[0, :8].tolist() == [2.0 * (c - 4) for c in range(8)]
    v2 = unpack(
        scheme("gptq", symmetric=False, v1=False),
        {"qweight": qweight, "qzeros": qzeros, "scales": scales},
        in_features=32,
    )
    assert v2.zeros.flatten().tolist() == [3] + [7] * 7  # gptq_v2 stores them as they are


def test_compressed_tensors_pack_input_columns_in_order_each_code_plus_8():
    packed = torch.zeros(8, 4, dtype=torch.int32)  # [N, K / 8]
    packed[0, 0] = words(0x89ABCDEF)[0]  # columns 0..7 of row 0: 15, 14, ..., 8
    packed[1, :] = words(0x88888888)[0]  # row 1: every code 8, a signed 0
    scale = torch.full((8, 1), 0.25, dtype=torch.bfloat16)
    tensors = {
        "weight_packed": packed,
        "weight_scale": scale,
        "weight_shape": torch.tensor([8, 32]),
    }
    symmetric = unpack(scheme("compressed-tensors", symmetric=True), tensors, in_features=32)
    assert symmetric.codes[0, :8].tolist() == list(range(15, 7, -1))
    assert symmetric.dequantize()[0, :8].tolist() == [0.25 * s for s in range(7, -1, -1)]
    assert symmetric.dequantize()[1].abs().sum() == 0
    # Asymmetric: zero points packed along the output rows, also plus 8.
    zero_point = words(0x00000009).view(1, 1)  # row 0: 9 (a signed 1); rows 1..7: 0 (-8)
    asymmetric = unpack(
        scheme("compressed-tensors", symmetric=False),
        {**tensors, "weight_zero_point": zero_point},
        in_features=32,
    )
    assert asymmetric.zeros.flatten().tolist() == [9] + [0] * 7
    assert asymmetric.dequantize()[0, :8].tolist() == [0.25 * (c - 9) for c in range(15, 7, -1)]


def test_a_gptq_g_idx_out_of_order_is_refused():
    tensors = {
        "qweight": torch.zeros(4, 8, dtype=torch.int32),
        "qzeros": torch.zeros(1, 1, dtype=torch.int32),
        "scales": torch.ones(1, 8, dtype=torch.float16),
        "g_idx": torch.tensor([0] * 31 + [1]),
    }
    with pytest.raises(ValueError, match="g_idx"):
        unpack(scheme("gptq"), tensors, in_features=32)


# -- whole checkpoints against transformers ------------------------------------------------

SHAPE = FAMILIES["llama-wide"].config  # the shape of both families' "-wide" checkpoints
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _codes(weight: torch.Tensor, group: int, symmetric: bool):
    """The test's own 4-bit codes of ``weight`` [N, K]: codes 0..15, fp16 scales and
    integer zeros per row and group."""
    n, k = weight.shape
    grouped = weight.view(n, k // group, group)
    if symmetric:
        scale = grouped.abs().amax(-1) / 7
        zero = torch.full_like(scale, 8)
    else:
        low, high = grouped.amin(-1), grouped.amax(-1)
        scale = (high - low) / 15
        zero = torch.round(-low / scale).clamp(0, 15)
    scale = scale.half()
    codes = torch.round(grouped / scale.float()[..., None]) + zero[..., None]
    return codes.clamp(0, 15).to(torch.int64).view(n, k), scale, zero.to(torch.int64)


def _pack_words(values: torch.Tensor, dim: int, order=tuple(range(8))) -> torch.Tensor:
    """Eight 4-bit values along ``dim`` per int32 word, value ``order[i]`` in nibble i."""
    values = values.movedim(dim, -1)
    grouped = values.reshape(*values.shape[:-1], -1, 8)[..., list(order)]
    word = (grouped << (4 * torch.arange(8))).sum(-1)
    word = torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)
    return word.movedim(-1, dim).contiguous()


def _layout(method: str, codes, scale, zero, group: int, v1: bool) -> dict[str, torch.Tensor]:
    """One linear's tensors in ``method``'s published layout."""
    if method == "awq":
        order = (0, 2, 4, 6, 1, 3, 5, 7)
        return {
            "qweight": _pack_words(codes.t(), 1, order),
            "qzeros": _pack_words(zero.t(), 1, order),
            "scales": scale.t().contiguous(),
        }
    if method == "gptq":
        return {
            "qweight": _pack_words(codes.t(), 0),
            "qzeros": _pack_words(zero.t() - int(v1), 1),
            "scales": scale.t().contiguous(),
            "g_idx": torch.arange(codes.shape[1], dtype=torch.int32) // group,
        }
    tensors = {
        "weight_packed": _pack_words(codes, 1),
        "weight_scale": scale.contiguous(),
        "weight_shape": torch.tensor(list(codes.shape)),
    }
    if not bool((zero == 8).all()):
        tensors["weight_zero_point"] = _pack_words(zero, 0)
    return tensors


def _quantization_config(method: str, group: int | None, symmetric: bool, v1: bool) -> dict:
    if method == "awq":
        return {
            "quant_method": "awq",
            "bits": 4,
            "group_size": group,
            "zero_point": True,
            "version": "gemm",
        }
    if method == "gptq":
        return {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": group or -1,
            "desc_act": False,
            "sym": symmetric,
            "checkpoint_format": "gptq" if v1 else "gptq_v2",
        }
    weights = {"num_bits": 4, "type": "int", "symmetric": symmetric, "dynamic": False}
    weights.update({"strategy": "group", "group_size": group} if group else {"strategy": "channel"})
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
        "ignore": ["lm_head"],
    }


def make_quantized(
    root, kind: str, method: str, group: int | None, symmetric: bool, v1=False, **changes
):
    """(quantized checkpoint, float32 checkpoint of the weights its codes stand for);
    ``changes`` to the tiny config."""
    model = tiny_model(f"{kind}-wide", **changes)
    reference, quantized = root / "float", root / method
    state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    packed = {}
    for name in list(state):
        prefix, _, leaf = name.rpartition(".")
        if leaf != "weight" or prefix.rpartition(".")[2] not in LINEARS:
            continue
        weight = state[name]
        columns = group or weight.shape[1]
        codes, scale, zero = _codes(weight, columns, symmetric)
        state[name] = (
            (codes - zero.repeat_interleave(columns, 1))
            * scale.float().repeat_interleave(columns, 1)
        ).float()
        for suffix, tensor in _layout(method, codes, scale, zero, columns, v1).items():
            packed[f"{prefix}.{suffix}"] = tensor
    model.load_state_dict(state)
    model.save_pretrained(reference)
    model.save_pretrained(quantized)
    tensors = load_file(quantized / "model.safetensors")
    kept = {n: t for n, t in tensors.items() if n not in _quantized_weight_names(packed)}
    save_file({**kept, **packed}, quantized / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((quantized / "config.json").read_text())
    raw["quantization_config"] = _quantization_config(method, group, symmetric, v1)
    (quantized / "config.json").write_text(json.dumps(raw))
    return quantized, reference


def _quantized_weight_names(packed: dict[str, torch.Tensor]) -> set[str]:
    return {f"{name.rpartition('.')[0]}.weight" for name in packed}


CASES = [
    ("llama", "awq", 32, False, False),
    ("qwen2", "awq", 128, False, False),
    ("llama", "gptq", 64, True, True),
    ("qwen2", "gptq", 128, False, True),
    ("llama", "gptq", 32, False, False),
    ("qwen2", "compressed-tensors", 32, True, False),
    ("llama", "compressed-tensors", 64, False, False),
    ("llama", "compressed-tensors", None, True, False),
]


@pytest.mark.parametrize(
    "kind, method, group, symmetric, v1",
    CASES,
    ids=[
        f"{m}-{k}-{'g' + str(g) if g else 'channel'}-{'sym' if s else 'asym'}{'-v1' if v else ''}"
        for k, m, g, s, v in CASES
    ],
)
def test_logits_match_transformers_on_the_weights_the_codes_stand_for(
    tmp_path, kind, method, group, symmetric, v1
):
    quantized, reference = make_quantized(tmp_path, kind, method, group, symmetric, v1)
    llm = probed(quantized, block_size=4, num_kv_blocks=64, activations="float32")
    linears = [m for m in llm.engine._runner.model.modules() if isinstance(m, PackedLinear)]  # noqa: SLF001
    assert sum(m.format.name == "int4" for m in linears) == 4 * SHAPE["num_hidden_layers"]
    outputs = llm.generate(PROMPTS, greedy(8))
    seen = records(llm)
    model = transformers.AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        sequence = prompt + output.outputs[0].token_ids
        with torch.no_grad():
            expected = model(torch.tensor([sequence])).logits[0, len(prompt) - 1 : -1]
        # The kernel sums codes and takes each group's zero off once per group (as for
        # the int4 format made at load): the tolerance of that format's own test.
        torch.testing.assert_close(logits_of(seen, output), expected, atol=1e-4, rtol=1e-4)


# -- refused by name -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "config, named",
    [
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}, "desc_act"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "gemv"),
        ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "8-bit"),
        ({"quant_method": "awq", "bits": 4, "group_size": 96}, "group_size 96"),
        ({"quant_method": "fp8"}, "fp8"),
        ({"quant_method": "compressed-tensors", "format": "float-quantized"}, "float-quantized"),
    ],
)
def test_a_quantization_it_cannot_read_is_refused_by_name(config, named):
    with pytest.raises(ValueError, match=named):
        QuantizedCheckpoint.from_config(config)


def test_a_prequantized_checkpoint_is_not_quantized_again_or_split(tmp_path, pool):
    quantized, _ = make_quantized(tmp_path, "llama", "awq", 32, False)
    with pytest.raises(ValueError, match="no --quantization"):
        LLM(quantized, quantization="int8")
    with pytest.raises(ValueError, match="tensor_parallel_size 1"):
        LLM(quantized, tensor_parallel_size=2, worker_pool=pool)
