"""What tests observe of a running engine without the engine keeping it for them."""

from __future__ import annotations

from collections import defaultdict

import torch

from updraft import LLM, RequestOutput


class LogitsProbe:
    """Keeps, per request, the logits row each emitted token was drawn from, by wrapping
    the target runner's ``sample``: a verify step's row j belongs to the j-th token it
    emits for a request, a plain step's single row to its one token."""

    def __init__(self, llm: LLM) -> None:
        self.rows: dict[str, list[torch.Tensor]] = defaultdict(list)
        runner = llm.engine._runner
        sample = runner.sample

        def spy(logits, inputs):
            tokens = sample(logits, inputs)
            offset = 0
            for row, num_drafts, emitted in zip(
                inputs.sampling_rows, inputs.num_drafts, tokens.token_ids, strict=True
            ):
                rows = logits[offset : offset + len(emitted)].cpu()
                self.rows[inputs.request_ids[row]].extend(rows)
                offset += 1 + num_drafts
            return tokens

        runner.sample = spy

    def of(self, output: RequestOutput) -> torch.Tensor:
        """[output tokens, vocab]: tokens dropped after a stop are left out."""
        count = len(output.outputs[0].token_ids)
        rows = self.rows[output.request_id]
        assert len(rows) >= count, "a token was emitted without its logits being seen"
        return torch.stack(rows[:count])


def assert_idle(llm: LLM) -> None:
    """No request left, no KV block held."""
    stats = llm.engine.stats()
    assert stats.kv_blocks_used == 0
    assert stats.num_running == stats.num_waiting == 0
