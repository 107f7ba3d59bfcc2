"""A rank other than 0 of a split model: it runs each message rank 0 sends
(``rank_messages.py``) on its runner of that name."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from updraft.runner.rank_messages import RankLoop, RankMessage

if TYPE_CHECKING:
    from updraft.runner.runner import Runner


class Follower:
    """A rank other than 0: runs each message on its runner of that name, keeping the
    hidden states each runner returned last (what the next messages' rows refer to)."""

    def __init__(self, runners: list[Runner]) -> None:
        self.runners = {runner.name: runner for runner in runners}
        self.hidden: dict[str, torch.Tensor] = {}

    def run(self, message: RankMessage) -> None:
        runner = self.runners[message.runner]
        hidden = None
        if message.hidden_from is not None:
            hidden = message.hidden_from.of(self.hidden[message.hidden_from.runner])
        if isinstance(message, RankLoop):
            inputs = replace(message.inputs, hidden_states=hidden)
            runner.draft_loop(inputs, message.request_ids)
            return
        step = message.inputs
        if hidden is not None:
            step = replace(step, forward=replace(step.forward, hidden_states=hidden))
        forward = runner.forward(step)
        if forward.hidden_states is not None:
            self.hidden[runner.name] = forward.hidden_states
