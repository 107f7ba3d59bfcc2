"""How weights are kept and computed: the compute dtypes, the formats linear and expert
weights are kept in (float, or quantized at load), the detection of checkpoints quantized
elsewhere (AWQ, GPTQ, compressed-tensors), and the choice of format for a run.

By name only at import: this module is what ``updraft --help`` reads, and must not
import torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

DTYPES = ("float32", "float16", "bfloat16")
QUANTIZATIONS = ("int8", "int4")
# How quantized linears take their activations (``models/activations.py``).
ACTIVATIONS = ("auto", "int8", "float32")
INT4_GROUP_SIZES = (32, 128)
HALF_DTYPES = ("float16", "bfloat16")


def torch_dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, name)


@dataclass(frozen=True)
class WeightFormat:
    """How linear and expert weights are kept in memory: ``float32``, ``bfloat16`` or
    ``float16`` as they are, or quantized to ``int8`` (one scale per output row, or per
    ``group_size`` columns) or ``int4`` (per ``group_size`` columns, with a zero point per
    group where ``zero_point``)."""

    name: str
    group_size: int | None = None
    zero_point: bool = False
    # bfloat16 weights multiply float32 x exactly at every row count (``--activations
    # float32``), not x rounded to bfloat16 where the CPU multiplies bfloat16 natively
    # (kernels/linear.c). How the weights are computed with, not how they are kept.
    exact: bool = field(default=False, compare=False)

    @classmethod
    def of(cls, dtype: torch.dtype) -> WeightFormat:
        """Weights kept in ``dtype`` as they are."""
        return cls(str(dtype).removeprefix("torch."))

    @property
    def quantized(self) -> bool:
        return self.name in QUANTIZATIONS

    def __str__(self) -> str:
        if not self.quantized:
            return self.name
        group = f", groups of {self.group_size}" if self.group_size else ""
        return f"{self.name}{group}{', zero points' if self.zero_point else ''}"


PREQUANTIZED_METHODS = ("awq", "gptq", "compressed-tensors", "mxfp4")
PREQUANTIZED_GROUP_SIZES = (32, 64, 128)
# What each method's tensors of one linear are called (the first names the linear).
PREQUANTIZED_TENSORS = {
    "awq": ("qweight", "qzeros", "scales"),
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "compressed-tensors": ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape"),
    # experts only: ``{gate_up,down}_proj_blocks`` and ``_scales`` (models/mxfp4_experts.py)
    "mxfp4": ("blocks", "scales"),
}


@dataclass(frozen=True)
class QuantizedCheckpoint:
    """How a checkpoint's linears are quantized (``quantization_config``)."""

    method: str
    group_size: int | None  # None: one group per row (per-channel)
    symmetric: bool
    gptq_v1_zeros: bool = False  # GPTQ's original format stores each zero minus one

    @property
    def marker(self) -> str:
        """The tensor suffix that names a quantized linear."""
        return PREQUANTIZED_TENSORS[self.method][0]

    @property
    def suffixes(self) -> tuple[str, ...]:
        return PREQUANTIZED_TENSORS[self.method]

    @classmethod
    def from_config(cls, raw: dict[str, Any]) -> QuantizedCheckpoint:
        """The scheme of a ``quantization_config``; one that is not 4-bit weight-only in
        a layout read here is refused, by name."""
        method = str(raw.get("quant_method", "?")).lower()
        if method not in PREQUANTIZED_METHODS:
            raise ValueError(
                f"quantization_config: quant_method {method!r} is not supported "
                f"({', '.join(PREQUANTIZED_METHODS)} are, with 4-bit weights)"
            )
        if method == "compressed-tensors":
            return cls._compressed_tensors(raw)
        if method == "mxfp4":  # FP4 codes, a power-of-two scale per 32: nothing to choose
            return cls("mxfp4", 32, symmetric=True)
        bits = raw.get("bits", raw.get("w_bit"))
        if bits != 4:
            raise ValueError(f"quantization_config: {method} with {bits}-bit weights (4 is read)")
        group = raw.get("group_size", raw.get("q_group_size"))
        if method == "awq":
            version = str(raw.get("version", "gemm")).lower()
            if version != "gemm":
                raise ValueError(
                    f"quantization_config: AWQ version {version!r} is not supported (gemm is)"
                )
            return cls("awq", _group(group), symmetric=not raw.get("zero_point", True))
        if raw.get("desc_act"):
            raise ValueError(
                "quantization_config: GPTQ desc_act (act-order, a g_idx that is not in "
                "order) is not supported; quantize with desc_act false"
            )
        fmt = str(raw.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(
                f"quantization_config: GPTQ checkpoint_format {fmt!r} is not supported "
                "(gptq and gptq_v2 are)"
            )
        if raw.get("lm_head"):
            raise ValueError("quantization_config: a GPTQ-quantized lm_head is not supported")
        return cls(
            "gptq", _group(group), symmetric=bool(raw.get("sym", True)), gptq_v1_zeros=fmt == "gptq"
        )

    @classmethod
    def _compressed_tensors(cls, raw: dict[str, Any]) -> QuantizedCheckpoint:
        fmt = raw.get("format")
        if fmt != "pack-quantized":
            raise ValueError(
                f"quantization_config: compressed-tensors format {fmt!r} is not supported "
                "(pack-quantized, W4A16, is)"
            )
        groups = list((raw.get("config_groups") or {}).values())
        if len(groups) != 1:
            raise ValueError(
                f"quantization_config: {len(groups)} compressed-tensors config_groups "
                "(one is supported)"
            )
        weights = groups[0].get("weights") or {}
        if groups[0].get("input_activations"):
            raise ValueError(
                "quantization_config: quantized activations (compressed-tensors "
                "input_activations) are not supported; W4A16 is"
            )
        if weights.get("num_bits") != 4 or weights.get("type", "int") != "int":
            raise ValueError(
                f"quantization_config: compressed-tensors weights of {weights.get('num_bits')} "
                f"bits, type {weights.get('type')!r} (4-bit int is read)"
            )
        if weights.get("actorder"):
            raise ValueError(
                "quantization_config: compressed-tensors actorder (weight_g_idx) is not supported"
            )
        strategy = weights.get("strategy")
        if strategy not in ("group", "channel"):
            raise ValueError(
                f"quantization_config: compressed-tensors strategy {strategy!r} "
                "(group and channel are read)"
            )
        group = _group(weights.get("group_size")) if strategy == "group" else None
        return cls("compressed-tensors", group, symmetric=bool(weights.get("symmetric", True)))


def _group(value: Any) -> int | None:
    if value in (None, -1):
        return None
    if value not in PREQUANTIZED_GROUP_SIZES:
        raise ValueError(
            f"quantization_config: group_size {value!r} is not supported "
            f"({', '.join(map(str, PREQUANTIZED_GROUP_SIZES))} or per-channel are)"
        )
    return value


def compute_dtype(dtype: str, device: str, checkpoint_dtype: str) -> torch.dtype:
    """The dtype a run computes in: ``dtype`` as asked; for ``auto``, float32 on the CPU
    (half-precision matmuls are slow on most CPUs) and the checkpoint's dtype elsewhere."""
    if dtype != "auto":
        return torch_dtype(dtype)
    return torch_dtype("float32" if device == "cpu" else checkpoint_dtype)


def choose_format(
    *,
    dtype: str,
    device: str,
    quantization: str | None,
    group_size: int,
    checkpoint_dtype: str,
    prequantized: QuantizedCheckpoint | None,
) -> WeightFormat:
    """How the linear and expert weights are kept: quantized as asked; else, with
    ``dtype`` auto on the CPU, in a half-precision checkpoint's own dtype (the
    kernels widen them in registers); else in the compute dtype."""
    compute = compute_dtype(dtype, device, checkpoint_dtype)
    if prequantized is not None and (
        quantization is not None or device != "cpu" or str(compute) != "torch.float32"
    ):
        raise ValueError(
            f"a {prequantized.method} checkpoint runs on the CPU in float32 with its "
            "own 4-bit weights (no --quantization, --dtype auto or float32)"
        )
    if quantization is not None:
        if device != "cpu" or str(compute) != "torch.float32":
            raise ValueError(
                f"quantization {quantization!r} runs on the CPU in float32, not on "
                f"{device} in {str(compute).removeprefix('torch.')}"
            )
        if quantization == "int8":
            return WeightFormat("int8")
        return WeightFormat("int4", group_size, zero_point=True)
    if device == "cpu" and dtype == "auto" and checkpoint_dtype in HALF_DTYPES:
        return WeightFormat(checkpoint_dtype)
    return WeightFormat.of(compute)
