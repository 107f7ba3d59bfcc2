"""What tests observe of a running engine without the engine keeping it for them."""

from __future__ import annotations

from collections import defaultdict

import torch

from updraft import LLM, RequestOutput, SamplingParams


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


def recorded_speculative_run(checkpoint, token_budget: int, prepare=None, **engine_args):
    """Generate three greedy prompts with and without the speculation ``engine_args``
    asks for, recording every proposal with the tokens it was made from;
    ``prepare(proposer)`` runs first. -> (plain outputs, speculative outputs, proposals
    as (tokens, drafts), proposer)."""
    prompts = [list(range(10, 31)), [5, 6, 7] * 5, list(range(100, 137))]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (14, 9, 11)]
    args = dict(block_size=4, num_kv_blocks=256, max_num_batched_tokens=token_budget)
    plain = LLM(checkpoint, **args).generate(prompts, params)
    llm = LLM(checkpoint, num_speculative_tokens=2, **args, **engine_args)
    proposer = llm.engine._proposer
    if prepare is not None:
        prepare(proposer)
    seen = []
    propose = proposer.propose

    def spy(inputs, output, drafting):
        drafts = propose(inputs, output, drafting)
        for request, _ in drafting:
            if request.request_id in drafts:
                seen.append((list(request.token_ids), drafts[request.request_id].token_ids))
        return drafts

    proposer.propose = spy
    return plain, llm.generate(prompts, params), seen, proposer


def forget_refresh(name: str, in_draft_loop: bool = False):
    """A ``prepare`` for ``recorded_speculative_run`` that stops one declared input of a
    head proposer's graphs from being refreshed, as a path that forgot it would: of its
    captured steps (the mirror and eager-loop draft steps), or of its draft loop."""

    def forget(proposer) -> None:
        graphs = proposer.draft_loop.graphs if in_draft_loop else proposer.captured.graphs
        for graph, _ in graphs.values():
            (forgotten,) = [i for i in graph.inputs if i.name == name]
            object.__setattr__(forgotten, "refresh", lambda values: None)  # it is frozen

    return forget


# The draft loop's inputs, each of which a stale replay must show.
DRAFT_LOOP_MUTATIONS = {
    f"loop-{name}": forget_refresh(name, in_draft_loop=True)
    for name in ("input_ids", "hidden_states", "block_table", "positions", "draft_limits")
}
