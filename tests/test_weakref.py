"""weak_ref_tensors: same memory, no ownership, through nested containers."""

from __future__ import annotations

import torch

from updraft.graph.weakref import weak_ref_tensors


def test_weak_refs_alias_without_owning():
    base = torch.arange(12.0).view(3, 4)
    view = base[1:, 2:]
    weak = weak_ref_tensors(view)
    assert weak.data_ptr() == view.data_ptr() and weak.shape == view.shape
    assert weak.stride() == view.stride()
    base[2, 3] = -1.0
    assert weak[1, 1] == -1.0
    # The owning tensor's storage is referenced only by its owners, not by the weak ref.
    refs = torch._C._storage_Use_Count(view.untyped_storage()._cdata)
    del weak
    assert torch._C._storage_Use_Count(view.untyped_storage()._cdata) == refs


def test_nested_containers_and_other_values():
    a, b = torch.ones(2), torch.zeros(3)
    out = weak_ref_tensors({"x": [a, (b, 7)], "y": "name", "z": None})
    assert isinstance(out["x"], list) and isinstance(out["x"][1], tuple)
    assert out["x"][0].data_ptr() == a.data_ptr()
    assert out["x"][1][0].data_ptr() == b.data_ptr()
    assert out["x"][1][1] == 7 and out["y"] == "name" and out["z"] is None
