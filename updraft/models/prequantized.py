"""Checkpoints whose linear weights are already 4-bit: AWQ, GPTQ and compressed-tensors'
pack-quantized W4A16, read into the int4 panels of ``kernels/panels.py`` as they are.

Each layout packs eight 4-bit codes into an int32, differently:

* AWQ (``version: gemm``): ``qweight`` [K, N / 8] packs along output columns, and word
  nibble i holds column 8w + (0, 2, 4, 6, 1, 3, 5, 7)[i]; ``qzeros`` [K / g, N / 8] the
  same; ``scales`` [K / g, N]. weight = scale * (code - zero).
* GPTQ: ``qweight`` [K / 8, N] packs along input rows (nibble i: row 8w + i);
  ``qzeros`` [K / g, N / 8] along output columns, in order, stored minus one in the
  original format (``checkpoint_format: gptq``) and as they are in ``gptq_v2``;
  ``scales`` [K / g, N]; ``g_idx`` [K] each input row's group.
* compressed-tensors (``format: pack-quantized``): ``weight_packed`` [N, K / 8] along
  input columns, in order, each code stored plus 8 (a signed code -8..7 as 0..15);
  ``weight_scale`` [N, K / g]; for asymmetric schemes ``weight_zero_point`` [N / 8,
  K / g], packed along output rows, the same way. weight = scale * (code - zero).

Every one becomes codes 0..15 [N, K], and per row and group a scale and a zero (in code
units): exactly the int4 panels' weight = scale * (code - zero), so the 4-bit kernel
runs the checkpoint's own codes. Nothing is dequantized.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from updraft.weights import QuantizedCheckpoint

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the column word nibble i holds, of its eight


@dataclass(frozen=True)
class QuantizedCodes:
    """One linear's weight as int4 codes [N, K] (uint8, 0..15) with per row and group
    of ``group`` columns a scale and a zero point [N, K / group] (float32)."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group: int

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] (tests and checks)."""
        expand = self.group
        scales = self.scales.repeat_interleave(expand, dim=1)[:, : self.codes.shape[1]]
        zeros = self.zeros.repeat_interleave(expand, dim=1)[:, : self.codes.shape[1]]
        return (self.codes.float() - zeros) * scales


def unpack(
    scheme: QuantizedCheckpoint, tensors: dict[str, torch.Tensor], in_features: int
) -> QuantizedCodes:
    """One linear's tensors of a checkpoint quantized as ``scheme``, by suffix -> its
    codes, scales and zeros."""
    group = scheme.group_size or in_features
    if scheme.method == "awq":
        codes = _nibbles(tensors["qweight"], 1, AWQ_ORDER).t()
        zeros = _nibbles(tensors["qzeros"], 1, AWQ_ORDER).t()
        scales = tensors["scales"].t()
    elif scheme.method == "gptq":
        _check_in_order(tensors.get("g_idx"), group)
        codes = _nibbles(tensors["qweight"], 0).t()
        zeros = _nibbles(tensors["qzeros"], 1).t() + int(scheme.gptq_v1_zeros)
        scales = tensors["scales"].t()
    else:
        rows, columns = (int(n) for n in tensors["weight_shape"].tolist())
        codes = _nibbles(tensors["weight_packed"], 1)[:rows, :columns]
        scales = tensors["weight_scale"]
        if scheme.symmetric:
            zeros = torch.full(scales.shape, 8)
        else:
            zeros = _nibbles(tensors["weight_zero_point"], 0)[:rows]
    if codes.shape[1] != in_features or scales.shape[1] != -(-in_features // group):
        raise ValueError(
            f"{scheme.method} tensors of shape {tuple(codes.shape)} with "
            f"{scales.shape[1]} groups do not fit a linear of {in_features} inputs in "
            f"groups of {group}"
        )
    return QuantizedCodes(
        codes.to(torch.uint8).contiguous(),
        scales.float().contiguous(),
        zeros.float().contiguous(),
        group,
    )


def _nibbles(words: torch.Tensor, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 words -> their eight 4-bit codes each, laid out along ``dim`` (eight times
    as long): word nibble i (bits 4i .. 4i + 3) is element ``order[i]`` of its eight
    (default: element i)."""
    words = words.to(torch.int32)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    nibbles = (words.unsqueeze(-1) >> shifts) & 0xF  # [..., 8]: nibble i
    if order is not None:
        nibbles = nibbles[..., torch.tensor(order).argsort()]  # element j's nibble
    if dim == 1:
        return nibbles.flatten(-2)
    return nibbles.transpose(-1, -2).reshape(words.shape[0] * 8, *words.shape[1:])


def _check_in_order(g_idx: torch.Tensor | None, group: int) -> None:
    """GPTQ without act-order numbers the input rows' groups in order."""
    if g_idx is None:
        return
    expected = torch.arange(len(g_idx)) // group
    if not torch.equal(g_idx.long(), expected):
        raise ValueError(
            "GPTQ g_idx is not in order (act-order, desc_act): not supported; quantize "
            "with desc_act false"
        )
