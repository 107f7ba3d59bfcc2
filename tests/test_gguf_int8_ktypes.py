"""The int8-activation kernels of Q2_K, Q3_K, Q5_K and IQ4_XS (``kernels/int8_q2_k.h``
...): their groups give back the file's bytes exactly (packed sub-block scales decoded
to a byte each at load, and packed again), and x rounded to int8 times the groups equals
the float64 product of the rounded x and the gguf package's dequantization, in the
AVX-512 VNNI build, the AVX2 one (whose byte products saturate an int16 pair sum) and
the portable one (over each type's unpack_), on random blocks and on blocks of the
largest codes against x of the largest codes; a model in these types moves its logits by
about the rounding. The gguf package cannot quantize these types, so the blocks are
random bytes with finite half scales."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from benchmarks.peers import make_gguf
from tests.helpers import greedy, token_ids
from tests.probes import logits_of, probed, records
from tests.test_gguf import MIXES, SCALE_BYTES, convert_to, plain, random_blocks
from tests.test_reference_models import PROMPTS
from tests.test_weight_formats import cpu_flags
from updraft.kernels.gguf_ops import (
    BLOCK_TYPES,
    INT8_TYPES,
    gguf_group,
    gguf_linear_int8,
    gguf_round_x,
    gguf_ungroup,
    int8_kernel_builds,
)
from updraft.models import gguf_loader

pytestmark = pytest.mark.skipif(not int8_kernel_builds(), reason="the int8 kernel needs AVX2")
KINDS = ("Q2_K", "Q3_K", "Q5_K", "IQ4_XS")
# bytes of eight rows' block in a group: the file's, with Q3_K's, Q5_K's and IQ4_XS's
# packed six-bit sub-block scales a byte each
GROUP_BLOCK_BYTES = {
    "Q2_K": 8 * 84,
    "Q3_K": 8 * 110 + 32,
    "Q5_K": 8 * 176 + 32,
    "IQ4_XS": 8 * 136 + 16,
}
K = 512
N = 37  # a last group of five rows


def test_the_types_are_multiplied_in_int8():
    assert {BLOCK_TYPES[kind] for kind in KINDS} <= INT8_TYPES


@pytest.mark.parametrize("kind", KINDS)
def test_groups_give_back_the_file_s_bytes(kind):
    blocks = torch.from_numpy(random_blocks(kind, N, K, np.random.default_rng(0)))
    groups = gguf_group(blocks, BLOCK_TYPES[kind], K)
    assert groups.shape == (-(-N // 8), K // 256 * GROUP_BLOCK_BYTES[kind])
    assert torch.equal(gguf_ungroup(groups, BLOCK_TYPES[kind], K, N, torch.arange(N)), blocks)
    picked = torch.tensor([N - 1, 3, 0])
    assert torch.equal(gguf_ungroup(groups, BLOCK_TYPES[kind], K, N, picked), blocks[picked])


def _extreme_blocks(kind: str, rng: np.random.Generator) -> np.ndarray:
    """Blocks whose bytes, but for the half scales, are all 0x00 or all 0xFF: every
    code and sub-block scale at one end of its range (Q3_K's codes -4 or 3, IQ4_XS's
    -127 or 113, the others 0 or their largest)."""
    blocks = random_blocks(kind, N, K, rng).reshape(N, K // 256, -1)
    start, count = SCALE_BYTES[kind]
    halves = blocks[..., start : start + 2 * count].copy()
    blocks[:] = rng.choice(np.array([0, 255], dtype=np.uint8), size=(N, K // 256, 1))
    blocks[..., start : start + 2 * count] = halves
    return blocks.reshape(N, -1)


def _extreme_x(rows: int, rng: np.random.Generator) -> torch.Tensor:
    """x whose codes are all +-127, a sign per block of 32"""
    signs = rng.choice(np.array([-1.0, 1.0], dtype=np.float32), size=(rows, K // 32, 1))
    return torch.from_numpy(np.broadcast_to(signs, (rows, K // 32, 32)).reshape(rows, K).copy())


def _rounded(x: torch.Tensor) -> torch.Tensor:
    """Each row of x as the kernel rounds it, in float64."""
    rows = []
    for row in x:
        codes, scales = gguf_round_x(row)
        rows.append((codes.view(-1, 32).double() * scales[:, None].double()).view(-1))
    return torch.stack(rows)


def _skip_unless_runs(march: str) -> None:
    if march == "haswell" and not {"avx2", "fma", "f16c"} <= cpu_flags():
        pytest.skip("this CPU cannot run AVX2 code")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("march", ["native", "haswell", "x86-64"])
def test_int8_x_times_groups_is_the_rounded_x_times_the_dequantized_weight(kind, march):
    _skip_unless_runs(march)
    rng = np.random.default_rng(1)
    generator = torch.Generator().manual_seed(1)
    for blocks, extreme in (
        (random_blocks(kind, N, K, rng), False),
        (_extreme_blocks(kind, rng), True),
    ):
        weight = torch.from_numpy(quants.dequantize(blocks, GGMLQuantizationType[kind])).double()
        groups = gguf_group(torch.from_numpy(blocks), BLOCK_TYPES[kind], K)
        for rows in (1, 3, 8):
            x = _extreme_x(rows, rng) if extreme else torch.randn(rows, K, generator=generator) * 3
            rounded = _rounded(x)
            got = gguf_linear_int8(x, groups, None, BLOCK_TYPES[kind], K, N, march=march).double()
            expected = rounded @ weight.T
            # float32's rounding of each block's scaled sums, on the scale of the terms
            bound = 1e-5 * (rounded.abs() @ weight.abs().T) + 1e-6
            assert ((got - expected).abs() <= bound).all(), (rows, extreme)


def _one_at_a_time(model, activations: str) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Each prompt generated alone (decode steps of one row, where x is rounded)."""
    llm = probed(str(model), block_size=4, num_kv_blocks=64, activations=activations)
    outputs = [llm.generate([prompt], greedy(8))[0] for prompt in PROMPTS]
    seen = records(llm)
    modules = llm.engine._runner.model.modules()  # noqa: SLF001
    int8 = [m.int8 for m in modules if isinstance(m, gguf_loader.GGUFLinear)]
    assert int8 and all(int8) == (activations == "int8")
    return token_ids(outputs), [logits_of(seen, output) for output in outputs]


@pytest.mark.parametrize("mix", ["Q3_K_M-Q2_K", "IQ4_XS-IQ4_NL"])
def test_a_file_in_these_types_moves_the_logits_by_about_the_rounding(tmp_path, mix):
    """A model whose linears are in Q2_K, Q3_K, Q5_K (and Q6_K), or IQ4_XS: with x
    rounded to int8 its logits move by about the rounding, a percent of their scale."""
    checkpoint = plain("qwen3", tmp_path / "hf", hidden_size=256, intermediate_size=512)
    path = tmp_path / "model.gguf"
    make_gguf.main(checkpoint, path, convert_to(MIXES[mix], np.random.default_rng(1), {}))
    exact, rounded = _one_at_a_time(path, "float32"), _one_at_a_time(path, "int8")
    pairs = zip(rounded[0], exact[0], rounded[1], exact[1], strict=True)
    for tokens, exact_tokens, ours, theirs in pairs:
        # each step's logits up to the first token the two draw differently
        drawn = zip(tokens, exact_tokens, strict=True)
        split = next((i for i, (a, b) in enumerate(drawn) if a != b), None)
        steps = slice(0, None if split is None else split + 1)
        scale = theirs.abs().max()
        difference = (ours[steps] - theirs[steps]).abs().max()
        assert 1e-3 * scale < difference <= 0.03 * scale, (difference, scale)
