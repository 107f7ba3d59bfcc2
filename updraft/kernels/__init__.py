"""Small C kernels for the CPU, built on first use and registered as torch ops.

``torch.ops.updraft.panel_linear`` (a linear over weights in panels: float32, bfloat16,
float16, int8 or int4 groups, widened in registers), ``torch.ops.updraft.grouped_mlp``
(routed experts over the same panels) and ``torch.ops.updraft.paged_decode_attention``
(decode attention that reads the paged KV cache in place). Being torch ops, graph
capture records and replays them like aten ops. Importing the package defines them
(the GGUF blocks' ops are defined by ``gguf_ops``, which their loader imports).
"""

from updraft.kernels import attention_ops, ops

__all__ = ["attention_ops", "ops"]
