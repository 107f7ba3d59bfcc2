"""Gated DeltaNet layers (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) in a GGUF file, given back
as transformers' Qwen3.5 checkpoint holds them.

llama.cpp's converter changes these tensors on the way into the file, and each change
is undone here, before the loader places (or a rank shares) anything:

* ``ssm_a`` holds -exp(A_log): A_log is log(-ssm_a), in float64;
* every RMSNorm weight but the DeltaNet output's (``ssm_norm``) holds 1 + w: w is the
  file's value less 1, in float64 (exact wherever the converter's float32 sum was);
* ``ssm_conv1d`` is the conv's [channels, taps], without transformers' middle axis of 1;
* Qwen3-Next's ``in_proj_qkvz`` is ``attn_qkv`` and ``attn_gate`` in Qwen3.5's layout,
  or, in files of llama.cpp's first Qwen3-Next converter, ``ssm_in``, transformers'
  rows as they are (each key head's q, k, v and z rows in turn): split here into
  those two;
* Qwen3-Next's ``in_proj_ba`` is one tensor, ``ssm_ba`` (``ssm_beta_alpha`` in some
  files), each key head's beta rows then its alpha rows: they become Qwen3.5's
  ``ssm_beta`` and ``ssm_alpha``;
* Qwen3.5's files (``gguf_tiled_value_heads`` in the registry) hold the value heads
  tiled over the key heads (value head j of key head g at j * key_heads + g) where
  transformers groups them by key head (at g * per_key + j): the rows of the value part
  of ``attn_qkv`` and ``ssm_conv1d``, of ``attn_gate``, ``ssm_beta``, ``ssm_alpha``,
  ``ssm_a`` and ``ssm_dt``, and the columns of ``ssm_out``, are put back in groups.
  Rows in quantized blocks move whole; columns move as whole blocks where a head's
  width is a multiple of the block's. Else (a K-quant's 256 values over heads of 128)
  the blocks stay as the file has them and ``ssm_out`` takes its input in the file's
  order (``InputOrdered``: one gather of the layer's output per token), or, where the
  rank's share of the columns is cut from the file (tensor parallelism), the tensor is
  widened to float32 values (gguf-py's dequantizer) and its columns moved.

Blocks past the decoder layers (``nextn_predict_layers``: the multi-token prediction
layers) are not the decoder's and are passed over here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants
from torch import nn

from updraft.model_config.parts import LinearAttentionConfig
from updraft.models.gguf_mla import MadeTensor

LAYER = re.compile(r"blk\.(\d+)\.(.+)")
# The norms the converter stored as 1 + w (all but ssm_norm).
SHIFTED_NORMS = re.compile(
    r"output_norm\.weight|blk\.\d+\.(attn_norm|post_attention_norm|attn_q_norm|attn_k_norm)"
    r"\.weight"
)
# Qwen3-Next's fused beta/alpha rows, as the converter names them (and early files did).
FUSED_BETA_ALPHA = ("ssm_ba.weight", "ssm_beta_alpha.weight")
FLOATS = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


def grouped_order(key_heads: int, per_key: int, width: int) -> np.ndarray:
    """Indices that take the tiled value-head order to transformers' grouped one: entry
    i is where the grouped order's i-th value sits in the tiled order."""
    tiled = np.arange(key_heads * per_key * width).reshape(per_key, key_heads, width)
    return tiled.transpose(1, 0, 2).reshape(-1)


class LinearAttentionTensors:
    """Passes a file's tensors on with the converter's changes to the linear-attention
    layers (and the norms) undone, as transformers' tensors under llama.cpp's names."""

    def __init__(
        self,
        layers: int,
        linear: LinearAttentionConfig,
        tiled_value_heads: bool,
        keep_blocks: bool = True,
    ) -> None:
        """``keep_blocks``: an ``ssm_out`` whose blocks cannot move whole stays in them,
        and takes its input in the file's order (``order_inputs``); else it is widened."""
        self.layers = layers  # the decoder's; blocks past them are passed over
        self.keep_blocks = keep_blocks
        # out_proj module -> the order of its inputs that the file's columns take
        self.input_orders: dict[str, np.ndarray] = {}
        self.key_dim = linear.key_dim
        self.key_heads = linear.num_key_heads
        self.value_heads = linear.num_value_heads
        self.value_head_dim = linear.value_head_dim
        self.per_key = linear.num_value_heads // linear.num_key_heads
        self.tiled = tiled_value_heads and self.per_key > 1
        self.heads = grouped_order(self.key_heads, self.per_key, 1)
        self.values = grouped_order(self.key_heads, self.per_key, self.value_head_dim)

    def tensors(self, tensors: Iterable[Any], file_name: str) -> Iterator[Any]:
        for tensor in tensors:
            match = LAYER.fullmatch(tensor.name)
            if match is not None and int(match[1]) >= self.layers:
                continue  # a multi-token prediction layer
            what = match[2] if match is not None else tensor.name
            where = f"{file_name}: {tensor.name}"
            if SHIFTED_NORMS.fullmatch(tensor.name):
                yield _float(tensor.name, _values(tensor, where) - 1.0)
            elif what in FUSED_BETA_ALPHA:
                yield from self._beta_alpha(tensor, match[1])
            elif what == "ssm_in.weight":
                yield from self._qkvz(tensor, match[1])
            elif self.tiled or what in ("ssm_a", "ssm_conv1d.weight"):
                yield self._regrouped(tensor, what, where)
            else:
                yield tensor

    def _regrouped(self, tensor: Any, what: str, where: str) -> Any:
        """A tensor with its value heads back in transformers' order (where the file
        tiles them), and A_log and the conv's shape restored."""
        data, kind = np.asarray(tensor.data), tensor.tensor_type
        if what == "ssm_a":
            a = _values(tensor, where)
            if not (a < 0).all():
                raise ValueError(f"{where}: holds a value that is not negative: not -exp(A_log)")
            values = np.log(-a)
            return _float(tensor.name, values[self.heads] if self.tiled else values)
        if what == "ssm_conv1d.weight":
            values = _values(tensor, where)
            if self.tiled:
                values = _with_value_rows(values, self.key_dim, self.values)
            return _float(tensor.name, values[:, None, :])
        if not self.tiled:
            return tensor
        if what == "attn_qkv.weight":
            data = _with_value_rows(data, self.key_dim, self.values)
        elif what == "attn_gate.weight":
            data = data[self.values]
        elif what in ("ssm_beta.weight", "ssm_alpha.weight", "ssm_dt.bias"):
            data = data[self.heads]
        elif what == "ssm_out.weight":
            if self._kept_tiled(kind):
                layer = tensor.name.split(".")[1]
                module = f"model.layers.{layer}.linear_attn.out_proj"
                self.input_orders[module] = np.argsort(self.values)
                return tensor
            data, kind = self._out_columns(data, kind)
        else:
            return tensor
        return MadeTensor(tensor.name, np.ascontiguousarray(data), kind)

    def _kept_tiled(self, kind: Any) -> bool:
        """Whether ``ssm_out`` in ``kind`` stays as the file tiles its columns."""
        if kind in FLOATS or not self.keep_blocks:
            return False
        return self.value_head_dim % GGML_QUANT_SIZES[kind][0] != 0

    def order_inputs(self, model: nn.Module) -> None:
        """Each ``ssm_out`` left in the file's column order takes its input so."""
        modules = dict(model.named_modules())
        for name, order in self.input_orders.items():
            parent, _, child = name.rpartition(".")
            ordered = InputOrdered(modules[name], torch.from_numpy(order))
            setattr(modules[parent], child, ordered)

    def _out_columns(self, data: np.ndarray, kind: Any) -> tuple[np.ndarray, Any]:
        """``ssm_out``'s columns (the value heads' values) back in groups: whole blocks
        moved where a head is whole blocks wide, else the tensor widened to float32."""
        if kind in FLOATS:
            return data[:, self.values], kind
        width, size = GGML_QUANT_SIZES[kind]
        if self.value_head_dim % width == 0:
            blocks = data.reshape(data.shape[0], -1, size)
            per_head = self.value_head_dim // width
            order = grouped_order(self.key_heads, self.per_key, per_head)
            return blocks[:, order].reshape(data.shape), kind
        values = quants.dequantize(data, kind).astype(np.float32)
        return values[:, self.values], GGMLQuantizationType.F32

    def _qkvz(self, tensor: Any, layer: str) -> Iterator[MadeTensor]:
        """An early Qwen3-Next file's ``ssm_in`` (transformers' ``in_proj_qkvz``: per key
        head its q, k, v and z rows) as Qwen3.5's ``attn_qkv`` (every head's q, then k,
        then v) and ``attn_gate`` (z)."""
        data = np.asarray(tensor.data)
        key, value = self.key_dim // self.key_heads, self.per_key * self.value_head_dim
        heads = data.reshape(self.key_heads, 2 * key + 2 * value, *data.shape[1:])
        q, k, v, z = np.split(heads, np.cumsum([key, key, value]), axis=1)
        rows = [part.reshape(-1, *data.shape[1:]) for part in (q, k, v, z)]
        qkv = np.ascontiguousarray(np.concatenate(rows[:3]))
        yield MadeTensor(f"blk.{layer}.attn_qkv.weight", qkv, tensor.tensor_type)
        gate = np.ascontiguousarray(rows[3])
        yield MadeTensor(f"blk.{layer}.attn_gate.weight", gate, tensor.tensor_type)

    def _beta_alpha(self, tensor: Any, layer: str) -> Iterator[MadeTensor]:
        """Qwen3-Next's ``ssm_ba`` ([key heads, beta rows then alpha rows, ...]) as
        Qwen3.5's ``ssm_beta`` and ``ssm_alpha``."""
        data = np.asarray(tensor.data)
        grouped = data.reshape(self.key_heads, 2 * self.per_key, *data.shape[1:])
        for index, name in enumerate(("ssm_beta", "ssm_alpha")):
            rows = grouped[:, index * self.per_key : (index + 1) * self.per_key]
            rows = np.ascontiguousarray(rows.reshape(self.value_heads, *data.shape[1:]))
            yield MadeTensor(f"blk.{layer}.{name}.weight", rows, tensor.tensor_type)


class InputOrdered(nn.Module):
    """``linear`` over its input's features taken in ``order`` (its weight's columns
    are in that order)."""

    def __init__(self, linear: nn.Module, order: torch.Tensor) -> None:
        super().__init__()
        self.linear = linear
        self.register_buffer("order", order.long(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.index_select(-1, self.order))


def _with_value_rows(data: np.ndarray, key_dim: int, order: np.ndarray) -> np.ndarray:
    """q and k rows (``2 * key_dim``) as they are, then the value rows in ``order``."""
    qk = 2 * key_dim
    return np.concatenate([data[:qk], data[qk:][order]])


def _values(tensor: Any, where: str) -> np.ndarray:
    """A float tensor's values in float64 (a norm, A or the conv: never in blocks)."""
    if tensor.tensor_type not in FLOATS:
        raise ValueError(f"{where}: a {tensor.tensor_type.name} tensor, where floats are read")
    return quants.dequantize(np.asarray(tensor.data), tensor.tensor_type).astype(np.float64)


def _float(name: str, values: np.ndarray) -> MadeTensor:
    return MadeTensor(
        name, np.ascontiguousarray(values, dtype=np.float32), GGMLQuantizationType.F32
    )
