"""A hybrid model (Qwen3.5: Gated DeltaNet layers beside gated full attention) through
the engine: its greedy tokens equal transformers', eager and captured, across prefill
chunks and mixed batches; speculation over it is exact; each request holds one state
slot from admission to its end; and each way a step could read or keep the wrong state
is caught (tests/mutations.py)."""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.checkpoints import eagle_head_checkpoint, saved_model
from tests.conftest import add_byte_tokenizer
from tests.helpers import generate_logits, greedy, token_ids
from tests.mutations import (
    conv_window_shifted,
    forget_refresh,
    padded_rows_write_slot,
    restarts_from_the_slot,
    verify_keeps_only_its_last_state,
)
from tests.probes import logits_of, probed, records
from updraft import LLM, SamplingParams
from updraft.structured_outputs import StructuredOutputsParams

MAX_TOKENS = 12
# Prompts of mixed lengths, the longest over several prefill chunks of the budget below
# and over several blocks of the chunked delta rule.
LENGTHS = (150, 7, 41, 3, 90, 22, 64, 12)
# Batches of 1 to 8 requests replay buckets of 1, 4 and 8 (fewer graphs to capture).
SMALL_STEPS = {"max_num_batched_tokens": 48, "block_size": 8, "capture_sizes": (1, 4, 8)}


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randint(1, 256, (LENGTHS[i % len(LENGTHS)],), generator=generator).tolist()
        for i in range(count)
    ]


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3.5-engine")
    return saved_model("qwen3.5", directory), directory


@pytest.fixture(scope="module")
def expected(qwen35):
    """transformers' greedy tokens for ``prompts(8)``."""
    reference, _ = qwen35
    return [generate_logits(reference, prompt, MAX_TOKENS)[0] for prompt in prompts(8)]


def run(directory, batch: list[list[int]], **engine) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(directory), **{**SMALL_STEPS, **engine})
    return token_ids(llm.generate(batch, [greedy(MAX_TOKENS)] * len(batch))), llm


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_greedy_tokens_equal_transformers(qwen35, expected, eager):
    _, directory = qwen35
    got, llm = run(directory, prompts(8), enforce_eager=eager)
    assert got == expected
    stats = llm.engine.stats()
    assert stats.state_slots_used == 0 and stats.state_slots_total > 0
    assert stats.kv_blocks_used == 0
    if not eager:
        assert stats.steps["graph"] > 0


SPECULATION = {
    "ngram": {"speculative_method": "ngram", "num_speculative_tokens": 3},
    "draft-is-target": {"num_speculative_tokens": 3},
}


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_an_eagle_head_over_a_hybrid_target_is_exact(qwen35, expected, tmp_path, eager):
    """A random EAGLE head reads the hybrid target's hidden states; greedy tokens stay
    the target's own."""
    _, directory = qwen35
    head = eagle_head_checkpoint(tmp_path / "eagle", directory)
    got, llm = run(
        directory,
        prompts(8),
        speculative_method="eagle",
        speculative_model=str(head),
        num_speculative_tokens=3,
        enforce_eager=eager,
    )
    assert got == expected
    assert llm.engine.stats().speculative.rounds > 0


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
@pytest.mark.parametrize("method", sorted(SPECULATION))
def test_speculation_is_exact_at_batch_1_and_8(qwen35, expected, method, eager):
    """Greedy tokens under speculation equal plain greedy decoding; a draft model equal
    to the target runs the very recurrence the verify step runs, so every draft is
    accepted at every position."""
    _, directory = qwen35
    args = dict(SPECULATION[method], enforce_eager=eager)
    if method == "draft-is-target":
        args["speculative_model"] = str(directory)
    for batch in (1, 8):
        got, llm = run(directory, prompts(batch), **args)
        assert got == expected[:batch]
        stats = llm.engine.stats()
        assert stats.speculative.rounds > 0
        if method == "draft-is-target":
            assert stats.speculative.accepted == stats.speculative.proposed
        assert stats.state_slots_used == 0


# Four prompts of 80 tokens growing by 40 each, two at a time, in 24 blocks of 8: both
# running requests fit when admitted (10 blocks each) but not once grown (15 each).
TIGHT = {**SMALL_STEPS, "max_num_seqs": 2, "num_kv_blocks": 24}
TIGHT_TOKENS = 40


@pytest.fixture(scope="module")
def tight_expected(qwen35):
    reference, _ = qwen35
    return [generate_logits(reference, prompt, TIGHT_TOKENS)[0] for prompt in tight_prompts()]


def tight_prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(1, 256, (80,), generator=generator).tolist() for _ in range(4)]


def test_requests_wait_for_a_state_slot_and_preemption_recomputes_the_state(qwen35, tight_expected):
    """Two state slots for four requests: the others wait at admission. Running requests
    outgrow the cache and are preempted: they give their slot back and start again from
    a zero state. An abort frees its slot."""
    _, directory = qwen35
    llm = LLM(str(directory), **TIGHT, enforce_eager=False)
    assert llm.engine.stats().state_slots_total == 2
    outputs = llm.generate(tight_prompts(), [greedy(TIGHT_TOKENS)] * 4)
    assert sum(output.metrics.num_preemptions for output in outputs) > 0
    assert token_ids(outputs) == tight_expected
    stats = llm.engine.stats()
    assert stats.state_slots_used == 0 and stats.kv_blocks_used == 0
    engine = llm.engine
    request_id = engine.add_request(prompts(1)[0], greedy(50))
    engine.step()
    assert engine.stats().state_slots_used == 1
    engine.abort(request_id)
    assert engine.stats().state_slots_used == 0


@pytest.mark.parametrize("method", ["plain", "draft-is-target"])
def test_a_state_slot_the_graph_does_not_refresh_is_caught(qwen35, expected, monkeypatch, method):
    """The graphs replay the state slots of the step they captured (all padding: the
    spare slot) or of an earlier batch: the tokens go wrong."""
    _, directory = qwen35
    graph = "target" if method == "plain" else "draft"
    forget_refresh(monkeypatch, "state_slots", graph)
    args = {} if method == "plain" else {"speculative_model": str(directory)}
    got, llm = run(directory, prompts(8), enforce_eager=False, **args)
    if method == "plain":
        assert got != expected
    else:
        assert llm.engine.stats().speculative.acceptance_rate < 0.9


def test_sampling_under_speculation_draws_from_the_target_distribution(qwen35, tmp_path):
    """Sampled with a draft model of other weights, so that drafts are rejected: every
    logits row the target drew a token from (the rejection sampler keeps exactly that
    distribution) equals transformers' logits for the tokens before it. A rejected
    draft's state kept would move every later row."""
    reference, directory = qwen35
    saved_model("qwen3-next", tmp_path / "draft")  # other weights, the same vocabulary
    batch = prompts(4, seed=5)
    params = [
        SamplingParams(temperature=1.0, max_tokens=10, seed=i, ignore_eos=True) for i in range(4)
    ]
    llm = probed(
        str(directory),
        **SMALL_STEPS,
        speculative_model=str(tmp_path / "draft"),
        num_speculative_tokens=3,
        enforce_eager=False,
    )
    outputs = llm.generate(batch, params)
    metrics = llm.engine.stats().speculative
    assert 0 < metrics.num_accepted_tokens < metrics.num_draft_tokens
    seen = records(llm)
    for prompt, output in zip(batch, outputs, strict=True):
        tokens = output.outputs[0].token_ids
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
        torch.testing.assert_close(logits_of(seen, output), logits.float(), atol=2e-4, rtol=0)


def test_a_padded_request_writing_a_live_slot_is_caught(qwen35, expected, monkeypatch):
    """Three requests in a bucket of four: the padded fourth writes into slot 0, a live
    request's, when its pad is 0 rather than the spare slot."""
    _, directory = qwen35
    padded_rows_write_slot(monkeypatch, 0)
    batch = prompts(3)
    got, llm = run(directory, batch, enforce_eager=False)  # in a bucket of 4
    assert llm.engine.stats().steps["graph"] > 0
    assert got != expected[:3]


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_a_conv_window_shifted_by_one_is_caught(qwen35, expected, monkeypatch, eager):
    _, directory = qwen35
    conv_window_shifted(monkeypatch)
    got, _ = run(directory, prompts(8), enforce_eager=eager)
    assert got != expected


def test_a_preempted_request_resuming_from_a_stale_state_is_caught(
    qwen35, tight_expected, monkeypatch
):
    """A request computed again after preemption that reads its slot instead of
    starting from zeros goes wrong."""
    _, directory = qwen35
    restarts_from_the_slot(monkeypatch)
    llm = LLM(str(directory), **TIGHT)
    outputs = llm.generate(tight_prompts(), [greedy(TIGHT_TOKENS)] * 4)
    assert sum(output.metrics.num_preemptions for output in outputs) > 0
    assert token_ids(outputs) != tight_expected


@pytest.mark.parametrize("method", ["ngram", "other-draft"])
def test_a_verify_step_that_keeps_its_last_drafts_state_is_caught(
    qwen35, expected, monkeypatch, tmp_path, method
):
    """The state after a rejected draft kept: the next step starts from it. (Where every
    draft is accepted, as with draft == target, the last state is the right one.)"""
    _, directory = qwen35
    verify_keeps_only_its_last_state(monkeypatch)
    args = {"num_speculative_tokens": 3, "enforce_eager": False}
    if method == "ngram":
        args["speculative_method"] = "ngram"
    else:
        saved_model("qwen3-next", tmp_path / "draft")
        args["speculative_model"] = str(tmp_path / "draft")
    got, llm = run(directory, prompts(8), **args)
    metrics = llm.engine.stats().speculative
    assert metrics.num_accepted_tokens < metrics.num_draft_tokens
    assert got != expected


def test_speculation_stays_exact_under_grammars_penalties_and_n(qwen35, tmp_path):
    """Greedy requests with a regex, penalties and a logit bias, and one with n = 2,
    give the same text with and without speculation (n-gram and draft == target)."""
    _, directory = qwen35
    model = tmp_path / "with-tokenizer"
    shutil.copytree(directory, model)
    add_byte_tokenizer(model)
    params = [
        greedy(16, structured_outputs=StructuredOutputsParams(regex=r"[a-z]{4,12}( [0-9]+)?")),
        greedy(16, repetition_penalty=1.5, presence_penalty=0.5, logit_bias={65: 5.0}),
        greedy(16, n=2, frequency_penalty=0.3),
    ]
    batch = ["the state of", "abcabcabcabc", "x = 1\nx = 1\n"]
    plain = LLM(str(model), **SMALL_STEPS).generate(batch, params)
    for args in ({"speculative_method": "ngram"}, {"speculative_model": str(model)}):
        llm = LLM(str(model), **SMALL_STEPS, num_speculative_tokens=3, enforce_eager=False, **args)
        outputs = llm.generate(batch, params)
        assert [[c.text for c in o.outputs] for o in outputs] == [
            [c.text for c in o.outputs] for o in plain
        ]
        assert llm.engine.stats().speculative.rounds > 0
        assert llm.engine.stats().state_slots_used == 0
