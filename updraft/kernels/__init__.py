"""Small C kernels for the CPU, built on first use and registered as torch ops.

``torch.ops.updraft.int8_linear`` (weight-only int8 matmul) and
``torch.ops.updraft.paged_decode_attention`` (decode attention that reads the paged KV
cache in place). Being torch ops, graph capture records and replays them like aten ops.
"""
