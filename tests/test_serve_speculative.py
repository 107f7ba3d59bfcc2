"""The server carries speculative decoding: greedy output over HTTP equals plain
greedy, and /metrics reports acceptance per draft position."""

from __future__ import annotations

import openai

from tests.helpers import greedy
from updraft import LLM
from updraft.demo import DEMO_DRAFT_DIR

from .serving import MODEL, metric, running_server, wait_for_idle


def test_speculative_server_matches_plain_greedy_and_reports_acceptance():
    prompt = "def fibonacci(n):"
    (expected,) = LLM().generate(prompt, greedy(40, ignore_eos=False))
    with running_server(speculative_model=str(DEMO_DRAFT_DIR), num_speculative_tokens=3) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        response = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=40, temperature=0
        )
        assert response.choices[0].text == expected.outputs[0].text
        wait_for_idle(url)
        proposed = [
            metric(url, "updraft_spec_decode_draft_tokens", f'position="{i}"') for i in range(3)
        ]
        accepted = [
            metric(url, "updraft_spec_decode_accepted_tokens", f'position="{i}"') for i in range(3)
        ]
    assert all(p > 0 for p in proposed)
    assert all(0 <= a <= p for a, p in zip(accepted, proposed, strict=True))
    assert accepted[0] > 0
