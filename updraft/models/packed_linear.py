"""Linear layers on the CPU: weights packed once at load, in the format they are kept in.

Every format (float32, bfloat16, float16, int8, int4) is packed into the panels of
``kernels/panels.py`` and read by updraft's kernel ``updraft::panel_linear``: 16 output
rows at a time, one contiguous run of memory per panel, the weights widened to float32 in
registers, never in memory. For few rows (batch-1 decode, which reads every weight once
per token and does little else, a small batch or a speculative verify step) it reads the
weights at the memory's full speed; for more it widens each panel once into a buffer
that stays in cache and runs over every row.

A bfloat16 weight's batches (``ops.bf16_product_rows()`` rows and more), on a CPU with
AVX512-BF16, multiply x rounded to bfloat16 by the same panels, summing the products in
float32, as oneDNN's and vLLM's bfloat16 GEMMs do there: about twice the float32
multiply-add rate and no widening, for the rounding of x (a relative error of up to
2^-8 per value; fewer rows multiply x rounded alike, so no row's value depends on its
step's size). ``--activations float32`` (the format's ``exact``) keeps them exact, as
the transformers-parity tests do. Elsewhere nothing changes.

On a CPU with AVX-512, a float32 weight keeps a second packing for batches, oneDNN's
("prepacked", as vLLM's CPU backend and inductor's freezing do), taken from 5 rows up
(``FEW_ROWS``, more for a model that fits in cache): twice the linear weights' memory.
With AVX2 alone the panels beat it at every row count, 1.2-1.4x from 2 to 64 rows and
at the GEMM peak from 64 to 512 (benchmarks/RESULTS.md), so there a float32 weight,
like every other format, keeps one copy. The reordered weight is an opaque oneDNN
tensor: it has no storage to view or copy, and nothing but ``_linear_pointwise`` reads
it.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from pathlib import Path

import torch
from torch import nn

from updraft.kernels.build import kernel_builds
from updraft.kernels.ops import BF16_PRODUCTS
from updraft.kernels.panels import Panels, pack
from updraft.models.grouped_linear import quantized_grouped
from updraft.weights import WeightFormat

# The row count oneDNN lays a weight out for. Any count runs on the layout, but one laid
# out for a single row ran 1.2-2x slower from 4 rows up (a batched decode step), while
# one laid out for 16 rows ran a single row as fast (benchmarks/RESULTS.md).
PACKED_FOR_ROWS = 16
# Up to this many rows the panel kernel runs: on weights streamed from memory it is
# 1.1-1.6x faster than oneDNN up to 4 rows, and oneDNN is faster from 5
# (benchmarks/RESULTS.md).
FEW_ROWS = 4
# A model whose linear weights fit in a server CPU's last-level cache is bound by compute,
# not reads: there the panel kernel is as fast as oneDNN or faster up to 9 rows, and what
# matters more is that a batch-1 speculative round (1-row draft steps, a verify step of
# 1 + k <= 9 rows) stays on one copy of the weights. Alternating with oneDNN's packed copy
# keeps both in cache, and a 6-row verify step of the demo model ran 1.4x slower
# (benchmarks/RESULTS.md).
CACHED_FEW_ROWS = 9
# Where the machine does not say how large its last-level cache is.
DEFAULT_CACHE_BYTES = 32 * 2**20


SIZE_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30}


@cache
def last_level_cache_bytes(caches: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """The size of the CPU's largest-level cache, as Linux reports it in ``caches``."""
    sizes = {}
    for index in caches.glob("index*"):
        try:
            level = int((index / "level").read_text())
            size = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        if size[-1:] in SIZE_UNITS and size[:-1].isdigit():
            sizes[level] = int(size[:-1]) * SIZE_UNITS[size[-1]]
    return sizes[max(sizes)] if sizes else DEFAULT_CACHE_BYTES


def has_onednn() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_for_batches(capability: str | None = None) -> bool:
    """Whether float32 batches take oneDNN's packing, by the vector instructions torch
    dispatches to (``capability``, default ``torch.backends.cpu.get_cpu_capability()``):
    yes with AVX-512 (not measured against oneDNN since the panel kernel gained its
    prefetching) and on other CPUs (ARM, x86 without AVX2); no with AVX2 alone, where
    the panels are faster at every row count."""
    if not has_onednn():
        return False
    return (capability or torch.backends.cpu.get_cpu_capability()) != "AVX2"


def kernel_code(panels: Panels, fmt: WeightFormat) -> int:
    """The format ``panel_linear`` and ``grouped_mlp`` run ``panels`` in: bfloat16's in
    bfloat16 products (where the CPU has them) unless ``fmt.exact``, else the panels'
    own."""
    exact = fmt.exact or panels.format != "bfloat16"
    return panels.code if exact else BF16_PRODUCTS


def can_pack(device: torch.device, dtype: torch.dtype, fmt: WeightFormat) -> bool:
    """Whether a model computing in ``dtype`` on ``device`` runs packed linears (float32
    on the CPU); a format other than float32 needs the panel kernel to build."""
    if device.type != "cpu" or dtype != torch.float32:
        return False
    return kernel_builds("linear") or (fmt.name == "float32" and has_onednn())


class PackedLinear(nn.Module):
    def __init__(
        self,
        linear: nn.Linear,
        fmt: WeightFormat,
        few_rows: int = FEW_ROWS,
        panels: Panels | None = None,
    ) -> None:
        """``linear`` packed into ``fmt``; or, with ``panels`` (a checkpoint's own
        quantized codes), those panels, with ``linear`` giving only its shape and bias."""
        super().__init__()
        self.few_rows = few_rows  # up to this many rows, the panel kernel (float32)
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.format = fmt
        weight = linear.weight.detach()
        if panels is None and kernel_builds("linear"):
            panels = pack(weight, fmt)
        if panels is None and fmt.name != "float32":
            raise RuntimeError(f"{fmt} weights need updraft's linear kernel, which did not build")
        self.code, self.group = (kernel_code(panels, fmt), panels.group) if panels else (0, 0)
        for name in ("codes", "scales", "zeros"):
            self.register_buffer(name, getattr(panels, name, None), persistent=False)
        packed = None
        if fmt.name == "float32" and onednn_for_batches() and not weight.is_meta:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.float(), PACKED_FOR_ROWS)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.bias = (
            None
            if linear.bias is None
            else nn.Parameter(linear.bias.detach().float(), requires_grad=False)
        )

    @classmethod
    def over(cls, panels: Panels, bias: torch.Tensor | None, fmt: WeightFormat) -> PackedLinear:
        """A linear over ``panels`` already made (a checkpoint's own quantized codes),
        with ``bias``."""
        shape = nn.Linear(panels.in_features, panels.out_features, bias=False, device="meta")
        if bias is not None:
            shape.bias = nn.Parameter(bias.detach(), requires_grad=False)
        return cls(shape, fmt, panels=panels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features  # a Python int: fixed within a captured step
        if self.codes is not None and (self.packed_weight is None or rows <= self.few_rows):
            flat = x.reshape(rows, self.in_features)
            out = torch.ops.updraft.panel_linear(
                flat,
                self.codes,
                self.scales,
                self.zeros,
                self.bias,
                self.code,
                self.group,
                self.out_features,
            )
            return out.view(*x.shape[:-1], self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.format}"


def few_rows_for(model: nn.Module) -> int:
    """Up to how many rows ``model``'s float32 linears run on the panel kernel: more
    where their weights (all of them, filled or still on the meta device) fit in the
    last-level cache."""
    weights = {id(m.weight): m.weight.nbytes for m in model.modules() if isinstance(m, nn.Linear)}
    return CACHED_FEW_ROWS if sum(weights.values()) <= last_level_cache_bytes() else FEW_ROWS


def pack_linears(
    model: nn.Module,
    fmt: WeightFormat,
    few_rows: int | None = None,
    int8: bool = False,
    packed: Callable[[nn.Module], object] | None = None,
) -> None:
    """Replace every loaded ``nn.Linear`` of ``model`` (one still on the meta device
    waits for its weights) by a ``PackedLinear`` in ``fmt``, or with ``int8``
    (activations) and a quantized ``fmt``, by a ``GroupedLinear`` where its shape fits
    one; a weight tied to an embedding stays for the embedding. ``few_rows``: default
    ``few_rows_for(model)``. ``packed``: handed each linear once it is replaced (a
    loader drops the file pages its weight was read from)."""
    few_rows = few_rows_for(model) if few_rows is None else few_rows
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and not child.weight.is_meta:
                grouped = quantized_grouped(child, fmt) if int8 and fmt.quantized else None
                setattr(module, name, grouped or PackedLinear(child, fmt, few_rows))
                if packed is not None:
                    packed(child)
