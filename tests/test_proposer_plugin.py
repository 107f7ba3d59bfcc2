"""A proposer that reads the target's hidden states plugs in with one registration and
no change to the engine or the scheduler; with graphs on, the hidden states it receives
are those of transformers' forward over the same tokens."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
import transformers

from tests.helpers import greedy
from updraft import LLM
from updraft.speculative.registry import PROPOSERS, register_proposer
from updraft.step.plan import Draft


class HiddenStateRecorder:
    """Keeps the hidden state of every token whose whole query prefix ends up in the
    sequence (known tokens, and drafts up to the accepted ones), keyed by request and
    position; drafts repeat the last token, which keeps verify steps uniform."""

    wants_hidden_states = True
    runner = None

    def __init__(self, k: int) -> None:
        self.k = k
        self.states: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)
        self.modes: list[str] = []

    def propose(self, inputs, output, drafting):
        assert output.hidden_states is not None
        assert output.hidden_states.shape[0] == inputs.num_tokens
        self.modes.append(output.mode)
        accepted = dict(zip(output.request_ids, output.num_accepted, strict=True))
        drafts = dict(zip(inputs.sampling.rows, inputs.sampling.num_drafts, strict=True))
        bounds = inputs.forward.query_starts
        for row, request_id in enumerate(inputs.request_ids):
            first, end = bounds[row], bounds[row + 1]
            valid = end - first - drafts.get(row, 0) + accepted.get(request_id, 0)
            for token in range(first, first + valid):
                position = int(inputs.forward.positions[token])
                self.states[request_id][position] = output.hidden_states[token].clone()
        return {
            request.request_id: Draft([request.token_ids[-1]] * limit)
            for request, limit in drafting
        }


@pytest.fixture
def recorder():
    made = []

    def factory(context):
        made.append(HiddenStateRecorder(context.config.num_speculative_tokens))
        return made[-1]

    register_proposer("hidden-state-recorder", factory)
    yield made
    del PROPOSERS["hidden-state-recorder"]


def test_a_hidden_state_proposer_receives_the_targets_states(tiny_llama, recorder):
    llm = LLM(
        tiny_llama,
        speculative_method="hidden-state-recorder",
        num_speculative_tokens=3,
        enforce_eager=False,
        block_size=4,
        num_kv_blocks=128,
        capture_sizes=(1, 2, 4),
    )
    prompts = [list(range(3, 10)), [200, 17], [5] * 9 + [6, 7]]
    params = [greedy(n) for n in (14, 9, 12)]
    outputs = llm.generate(prompts, params)
    (proposer,) = recorder
    assert "graph" in proposer.modes, "no verify step replayed a graph"
    assert llm.engine.stats().speculative.num_draft_tokens > 0
    reference = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    for prompt, output in zip(prompts, outputs, strict=True):
        sequence = prompt + output.outputs[0].token_ids
        with torch.no_grad():
            expected = reference.model(torch.tensor([sequence])).last_hidden_state[0]
        states = proposer.states[output.request_id]
        # Every position but the last token's (never fed back) was seen once verified.
        assert sorted(states) == list(range(len(sequence) - 1))
        got = torch.stack([states[p] for p in sorted(states)])
        torch.testing.assert_close(got, expected[: len(sequence) - 1], atol=1e-4, rtol=0)
