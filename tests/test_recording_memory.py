"""A recording frees its intermediates as the forward drops them: capturing a graph
holds about the arena it lays out, not every activation it recorded; a tensor the
forward still holds some way the recorder cannot see is never freed; and the replay
still equals the function run again."""

from __future__ import annotations

import torch

from tests.bounded import bounded
from updraft.graph.recorded import RecordedGraph

MIB = 2**20
ROWS, WIDTH, LAYERS = 512, 1024, 12  # 2 MiB an activation, three a layer
ACTIVATION_MIB = ROWS * WIDTH * 4 / MIB


class Deep(torch.nn.Module):
    """Layers whose activations only the next layer reads: kept, 72 MiB of them."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.rand(WIDTH) + 0.5)
        self.inputs = torch.zeros(ROWS, WIDTH)

    def forward(self) -> torch.Tensor:
        hidden = self.inputs
        for _ in range(LAYERS):
            hidden = torch.tanh(hidden * self.scale + 0.25) * 0.5 + hidden.cos() * 0.5
        return hidden.sum(-1)


def capture(model: torch.nn.Module) -> tuple[RecordedGraph, torch.Tensor, float]:
    graph = RecordedGraph(constants=model.parameters(), persistent=[model.inputs])
    with torch.inference_mode(), bounded(seconds=120, mib=400) as spent:
        out = graph.capture(model)
    return graph, out, spent.peak_mib


def test_recording_holds_about_its_arena_not_every_activation():
    torch.manual_seed(0)
    model = Deep()
    model.inputs.copy_(torch.randn(ROWS, WIDTH))
    graph, out, peak_mib = capture(model)
    arena_mib = graph.arena.numel() / MIB
    assert arena_mib <= 8 * ACTIVATION_MIB  # a few layers' worth, of 12
    # Every activation kept would be about 72 MiB (with the arena on top).
    assert peak_mib <= arena_mib + 6 * ACTIVATION_MIB, (peak_mib, arena_mib)
    for _ in range(2):
        model.inputs.copy_(torch.randn(ROWS, WIDTH))
        with torch.inference_mode():
            graph.replay({})
            torch.testing.assert_close(out, model(), rtol=0, atol=0)


class Stashes(torch.nn.Module):
    """Reads an activation again through ``.data``, a tensor the recorder never sees
    made, after dropping every tensor it saw over that storage."""

    def __init__(self) -> None:
        super().__init__()
        self.inputs = torch.zeros(64, 64)
        self.stash: list[torch.Tensor] = []

    def forward(self) -> torch.Tensor:
        first = self.inputs.sin()
        self.stash.append(first.data)
        del first
        later = [self.inputs * float(i) for i in range(4)]  # would reuse freed bytes
        return self.stash.pop() + sum(later)


def test_a_tensor_the_forward_still_holds_unseen_is_not_freed():
    model = Stashes()
    model.inputs.copy_(torch.randn(64, 64))
    graph = RecordedGraph(constants=[], persistent=[model.inputs])
    with torch.inference_mode():
        out = graph.capture(model)
        expected = model.inputs.sin() + sum(model.inputs * float(i) for i in range(4))
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        model.inputs.copy_(torch.randn(64, 64))
        graph.replay({})
        expected = model.inputs.sin() + sum(model.inputs * float(i) for i in range(4))
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
