"""Which activations a checkpoint's linears take (``--activations``): ``auto`` resolved
from the checkpoint and from what the loader can run, ``int8`` checked against both.

A quantized checkpoint computes with x rounded to int8 where every one of its weight
types has an integer kernel: a GGUF file's block types in ``gguf_ops.INT8_TYPES``, the
other quantized formats in ``INT8_FORMATS``. A float checkpoint keeps float32 x, and
``--activations float32`` keeps it for any checkpoint (the exact path).
"""

from __future__ import annotations

import logging
from pathlib import Path

from updraft.checkpoints.gguf import linked_block_types, linked_files
from updraft.config import EngineConfig
from updraft.kernels.gguf_ops import BLOCK_TYPES, INT8_TYPES, int8_kernel_builds, int8_simd_builds
from updraft.model_config import ModelConfig
from updraft.weights import ACTIVATIONS

# The quantized formats other than GGUF's blocks whose linears have integer kernels, by
# name: updraft's own (``--quantization`` int8, int4) and pre-quantized checkpoints'
# methods (awq, gptq, compressed-tensors): their grouped layouts (kernels/int8_groups.py).
INT8_FORMATS: frozenset[str] = frozenset({"int8", "int4", "awq", "gptq", "compressed-tensors"})

log = logging.getLogger(__name__)


def quantized_format(model_config: ModelConfig, quantization: str | None) -> str | None:
    """The name of the quantized format of a (non-GGUF) checkpoint's linears, if any:
    its pre-quantized method, else ``--quantization``'s."""
    return model_config.quantized.method if model_config.quantized else quantization


def int8_activations(config: EngineConfig, model_config: ModelConfig, draft: bool = False) -> bool:
    """Whether the linears of the checkpoint ``config.model`` take int8 x, for the
    setting ``config.activations``. ``auto``: yes for a quantized checkpoint all of whose
    weight types have integer kernels here, no for any other. ``int8`` on a float
    checkpoint, or on a format without kernels, is refused (a ``draft`` model takes
    ``auto`` then: int8 was asked of the target); a GGUF linear in a type without one is
    refused by the loader, which knows the tensor's name."""
    setting = "auto" if draft and config.activations == "int8" else config.activations
    if setting not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {', '.join(ACTIVATIONS)}, got {setting!r}")
    if setting == "float32":
        return False
    blocks = linked_block_types(Path(config.model))
    files = linked_files(Path(config.model))
    where = config.model if files is None else files[0]
    if blocks is not None:  # a GGUF file: the types of its blocks (none in a float file)
        kinds = blocks
        missing = [kind for kind in blocks if BLOCK_TYPES[kind] not in INT8_TYPES]
    else:
        fmt = quantized_format(model_config, config.quantization)
        kinds = [fmt] if fmt else []
        missing = [fmt] if fmt and fmt not in INT8_FORMATS else []
    if not kinds:
        if setting == "int8":
            raise ValueError(
                f"{where}: --activations int8 is for quantized weights (a GGUF file's "
                "blocks, --quantization, AWQ/GPTQ/compressed-tensors), and this "
                "checkpoint's weights are floats; leave --activations at auto or float32"
            )
        return False
    if not int8_kernel_builds():
        if setting == "int8":
            raise ValueError("--activations int8: the integer kernels do not build on this CPU")
        return False
    if setting == "auto" and not int8_simd_builds():
        # without AVX2 only the portable C kernel builds: exact, but some thirty times
        # slower than the float32 path it would replace
        log.info("%s: no AVX2 here, so float32 activations (--activations int8 forces)", where)
        return False
    if blocks is None and missing:
        if setting == "int8":
            raise ValueError(
                f"{where}: --activations int8: {missing[0]} weights have no integer "
                "kernel yet; --activations float32 (or auto) computes with them exactly"
            )
        return False
    if setting == "auto" and missing:
        log.info(
            "%s: GGUF type(s) %s have no integer kernel: float32 activations",
            where,
            ", ".join(missing),
        )
        return False
    return True
