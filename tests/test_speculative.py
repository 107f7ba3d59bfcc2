"""Speculative decoding through the engine: greedy outputs equal plain greedy decoding,
acceptance does not depend on whether steps replay graphs, and a draft step that reads
stale buffers shows up as lost acceptance."""

from __future__ import annotations

import random

import pytest
import torch

from tests.helpers import greedy, token_ids, token_prompts
from tests.mutations import draft_mirror_on, forget_refresh, previous_batch
from tests.probes import logits_of, probe_dir, probed, records
from updraft import LLM, SamplingParams
from updraft.demo import DEMO_DRAFT_DIR, DEMO_MODEL_DIR

CODE_PROMPTS = [
    "def fibonacci(n):",
    "import os\n\n\ndef list_files(path):",
    "class Stack:\n    def __init__(self):",
    "for i in range(10):",
]


def speculative_args(method: str, draft_dir) -> dict:
    if method == "ngram":
        return {"speculative_method": "ngram"}
    return {"speculative_model": str(draft_dir)}


@pytest.mark.parametrize("method", ["draft", "ngram"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_with_speculation_equals_greedy_without_on_the_demo_model(method, k):
    prompts = CODE_PROMPTS * 4  # a mixed batch of 16, lengths differ
    params = [greedy(n) for n in (40, 7, 23, 31) * 4]
    expected = token_ids(LLM().generate(prompts, params))
    for batch in (prompts[:1], prompts):
        llm = LLM(num_speculative_tokens=k, **speculative_args(method, DEMO_DRAFT_DIR))
        got = token_ids(llm.generate(batch, params[: len(batch)]))
        assert got == expected[: len(batch)]
        assert llm.engine.stats().kv_blocks_used == 0
        assert llm.engine.stats().speculative.rounds > 0


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_greedy_with_speculation_equals_greedy_without_on_tiny_models(tmp_path, kind):
    from tests.checkpoints import build_checkpoint

    target = build_checkpoint(kind, tmp_path / "target", seed=0)
    draft = build_checkpoint(kind, tmp_path / "draft", seed=1)
    prompts = token_prompts(16)
    params = [greedy(n) for n in (24, 5, 17, 11) * 4]
    args = dict(block_size=4, num_kv_blocks=512)
    plain_llm = probed(target, **args)
    plain = plain_llm.generate(prompts, params)
    plain_seen = records(plain_llm)
    for method in ("draft", "ngram"):
        for k in (1, 3, 5):
            llm = probed(
                target,
                num_speculative_tokens=k,
                **args,
                **speculative_args(method, draft),
            )
            outputs = llm.generate(prompts, params)
            assert token_ids(outputs) == token_ids(plain), (method, k)
            assert llm.engine.stats().kv_blocks_used == 0
            seen = records(llm)
            # Each emitted token's logits, from a verify position, are the decode step's.
            for got, expected in zip(outputs, plain, strict=True):
                torch.testing.assert_close(
                    logits_of(seen, got), logits_of(plain_seen, expected), atol=1e-4, rtol=0
                )


def self_drafting(model_dir, **engine_args) -> LLM:
    """The target drafts for itself: under greedy decoding every draft must be accepted,
    so any stale state in a draft step shows up as rejections."""
    return LLM(
        model_dir,
        speculative_model=str(model_dir),
        num_speculative_tokens=3,
        block_size=4,
        num_kv_blocks=512,
        capture_sizes=(1, 2, 4, 8, 16),
        **engine_args,
    )


def test_a_model_drafting_for_itself_has_every_draft_accepted(tiny_llama):
    for eager in (True, False):
        llm = self_drafting(tiny_llama, enforce_eager=eager)
        llm.generate(token_prompts(6), [greedy(n) for n in (20, 9, 14, 3, 17, 12)])
        metrics = llm.engine.stats().speculative
        assert metrics.num_draft_tokens > 50
        assert metrics.acceptance_rate == 1.0, metrics.summary()


@pytest.mark.parametrize("batch", [1, 16])
def test_acceptance_with_graphs_equals_acceptance_without(batch):
    prompts = (CODE_PROMPTS * 4)[:batch]
    params = [
        SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24, seed=i, ignore_eos=True)
        for i in range(batch)
    ]
    results = {}
    for eager in (True, False):
        llm = LLM(speculative_model=str(DEMO_DRAFT_DIR), enforce_eager=eager)
        outputs = llm.generate(prompts, params)
        stats = llm.engine.stats()
        metrics = stats.speculative
        results[eager] = (token_ids(outputs), metrics.proposed, metrics.accepted)
        if not eager:
            assert stats.steps["graph"] > 0
            assert stats.draft_steps["graph"] > 0
    assert results[True] == results[False]


def test_draft_steps_replay_graphs_and_verify_never_falls_back_silently():
    llm = LLM(speculative_model=str(DEMO_DRAFT_DIR), enforce_eager=False)
    llm.generate(CODE_PROMPTS, [greedy(30)] * len(CODE_PROMPTS))
    stats = llm.engine.stats()
    target_modes, draft_modes = stats.steps, stats.draft_steps
    # The only eager steps are prefills longer than the largest mixed bucket; every
    # verify and draft step replayed.
    eager_prefill = "eager (prefill above the largest captured tokens)"
    assert set(target_modes) <= {"graph", eager_prefill} and target_modes["graph"] > 0
    assert set(draft_modes) <= {"graph", eager_prefill} and draft_modes["graph"] > 0


@pytest.mark.parametrize("name", ["block_table", "slot_mapping"])
def test_a_draft_graph_that_skips_a_refresh_loses_acceptance(tiny_llama, monkeypatch, name):
    forget_refresh(monkeypatch, name, "draft")
    llm = self_drafting(tiny_llama, enforce_eager=False)
    llm.generate(token_prompts(6), [greedy(n) for n in (20, 9, 14, 3, 17, 12)])
    assert llm.engine.stats().speculative.acceptance_rate < 0.9


def test_a_first_draft_step_on_the_previous_batch_loses_acceptance(tiny_llama, monkeypatch):
    # The bug this guards against: the draft's mirror step runs on what was prepared
    # for the previous batch instead of the step the target just ran.
    draft_mirror_on(monkeypatch, previous_batch)
    llm = self_drafting(tiny_llama, enforce_eager=False)
    llm.generate(token_prompts(6), [greedy(n) for n in (20, 9, 14, 3, 17, 12)])
    assert llm.engine.stats().speculative.acceptance_rate < 0.9


def test_prefills_preemption_and_abort_mix_with_speculation(tiny_llama):
    """A tight cache forces preemption mid-speculation; requests arrive while others
    verify; one is aborted. Outputs still equal plain greedy and no block leaks."""
    prompts = token_prompts(10, seed=3)
    params = [greedy(n) for n in (30, 12, 25, 8, 30, 19, 5, 27, 14, 22)]
    expected = token_ids(LLM(tiny_llama, block_size=4, num_kv_blocks=512).generate(prompts, params))
    llm = LLM(
        tiny_llama,
        speculative_model=str(tiny_llama),
        block_size=4,
        num_kv_blocks=40,
        max_num_batched_tokens=64,
    )
    engine = llm.engine
    ids = [engine.add_request(p, s) for p, s in zip(prompts[:5], params[:5], strict=True)]
    finals = {}
    steps = 0
    while engine.has_unfinished:
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
        steps += 1
        if steps == 3:  # late arrivals join running speculative decodes
            ids += [engine.add_request(p, s) for p, s in zip(prompts[5:], params[5:], strict=True)]
            aborted = engine.add_request(prompts[0], greedy(50))
        if steps == 6:
            assert engine.abort(aborted)
    assert finals[aborted].outputs[0].finish_reason == "abort"
    assert [finals[i].outputs[0].token_ids for i in ids] == expected
    assert sum(finals[i].metrics.num_preemptions for i in ids) > 0
    assert engine.stats().kv_blocks_used == 0


def test_speculative_settings_are_checked(tiny_llama):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(speculative_method="ngram", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="speculative_method"):
        LLM(speculative_method="medusa")
    with pytest.raises(ValueError, match="eagle' needs speculative_model"):
        LLM(str(tiny_llama), speculative_method="eagle")
    with pytest.raises(ValueError, match="needs speculative_model"):
        LLM(speculative_method="draft")
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(DEMO_MODEL_DIR, speculative_model=str(tiny_llama))


def test_metrics_reach_request_outputs():
    llm = LLM(speculative_model=str(DEMO_DRAFT_DIR))
    (output,) = llm.generate(CODE_PROMPTS[:1], greedy(30))
    spec = output.metrics.speculative
    assert spec.num_draft_tokens > 0 and 0 < spec.num_accepted_tokens <= spec.num_draft_tokens
    assert len(spec.acceptance_per_position()) == 3
    assert 1 <= spec.mean_accepted_length <= 4


def test_prefix_cache_hits_keep_the_draft_cache_valid(tiny_llama):
    """A prompt whose head comes from the prefix cache is never run through the draft:
    the draft's KV for those blocks must still be there, written when the blocks were
    first computed, or the self-drafting model would reject drafts."""
    rng = random.Random(0)
    head = [rng.randrange(1, 256) for _ in range(37)]
    llm = self_drafting(tiny_llama, enforce_eager=False, probe=probe_dir())
    for i in range(4):
        llm.generate([[*head, i + 1, i + 2]], greedy(20))
    metrics = llm.engine.stats().speculative
    # The first step of each prompt is its prefill (eager, or replayed in a mixed
    # bucket, query length 0; one request's verify steps fill their own buckets): the
    # later ones hit the cache.
    prefills = [
        s
        for s in records(llm).steps_of("target")
        if s.mode == "eager (prefill above the largest captured tokens)"
        or (s.bucket and s.bucket[1] == 0)
    ]
    assert prefills[0].num_tokens > len(head) and prefills[1].num_tokens < len(head)
    assert metrics.num_draft_tokens > 40 and metrics.acceptance_rate == 1.0


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_stops_limits_and_logprobs_behave_as_without_speculation(method):
    """Several tokens land per step; a stop string, stop token or max_tokens inside
    them must end the request exactly where plain decoding ends it."""
    prompts = CODE_PROMPTS
    params = [
        greedy(60, ignore_eos=False, stop=["return"], logprobs=True),
        greedy(70, ignore_eos=False, logprobs=True),
        greedy(33, ignore_eos=False, stop_token_ids=[10]),
        greedy(50, ignore_eos=False, stop=["\n\n"]),
    ]
    plain = LLM().generate(prompts, params)
    llm = LLM(num_speculative_tokens=8, **speculative_args(method, DEMO_DRAFT_DIR))
    for got, expected in zip(llm.generate(prompts, params), plain, strict=True):
        g, e = got.outputs[0], expected.outputs[0]
        assert (g.text, g.token_ids, g.finish_reason, g.stop_reason) == (
            e.text,
            e.token_ids,
            e.finish_reason,
            e.stop_reason,
        )
        if e.logprobs is not None:
            torch.testing.assert_close(g.logprobs, e.logprobs, atol=1e-4, rtol=0)
    assert llm.engine.stats().kv_blocks_used == 0
