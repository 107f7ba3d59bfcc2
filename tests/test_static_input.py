"""StaticInput: fixed address, padded rows reset, bad sizes refused before writing."""

from __future__ import annotations

import pytest
import torch

from updraft.graph.static_input import StaticInput


def test_refresh_keeps_the_address_and_resets_padded_rows():
    table = StaticInput("block_table", torch.zeros(4, 3, dtype=torch.long), lambda s: s, pad=0)
    address = table.buffer.data_ptr()
    table.refresh(table.values(torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]])))
    table.refresh(table.values(torch.tensor([[11], [12]])))  # the batch shrinks
    assert table.buffer.tolist() == [[11, 0, 0], [12, 0, 0], [0, 0, 0], [0, 0, 0]]
    assert table.buffer.data_ptr() == address


def test_one_dimensional_inputs_pad_their_tail():
    slots = StaticInput("slot_mapping", torch.zeros(5, dtype=torch.long), lambda s: s, pad=-1)
    slots.refresh(slots.values(torch.tensor([3, 4, 5, 6, 7])))
    slots.refresh(slots.values(torch.tensor([9, 8])))
    assert slots.buffer.tolist() == [9, 8, -1, -1, -1]


def test_values_that_do_not_fit_are_refused_before_any_write():
    slots = StaticInput("slot_mapping", torch.zeros(2, dtype=torch.long), lambda s: s, pad=-1)
    with pytest.raises(ValueError, match=r"'slot_mapping'.*\(3,\).*\(2,\)"):
        slots.values(torch.tensor([1, 2, 3]))
    assert slots.buffer.tolist() == [0, 0]
