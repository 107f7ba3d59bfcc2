"""Draft heads, EAGLE-1 and DeepSeek's MTP layer alike, against references built from
transformers' own layers: the head's logits over a prefill and a decode; and through
the engine, every proposal is what the reference drafts from the same tokens, greedy
output is kept, graph replays read no stale input (each way of reading one is caught),
and the first draft costs no head step of its own."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch

from tests.heads import Head, make_head, prefill_then_decode
from tests.helpers import greedy, token_ids
from tests.mutations import first_draft_from_the_row_before, forget_refresh
from tests.probes import probed, records
from updraft import LLM
from updraft.attention.cache_groups import CacheSizes, allocate_caches, cache_groups
from updraft.model_config import ModelConfig
from updraft.models.loader import load_model
from updraft.speculative.head import HeadProposer


@pytest.fixture(scope="module", params=["eagle-llama", "eagle-qwen3", "mtp"])
def head(request, tmp_path_factory) -> Head:
    return make_head(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module", params=["eagle-llama", "mtp"])
def one_head_each(request, tmp_path_factory) -> Head:
    return make_head(request.param, tmp_path_factory.mktemp(f"{request.param}-mutations"))


@torch.inference_mode()
def test_the_head_matches_its_reference_over_a_prefill_and_a_decode(head):
    """The head's logits over a prefill chunk (gathered or expanded attention) and a
    decode (read in place from the head's cache) equal the reference's within 1e-4."""
    tokens = list(range(30, 50))
    features, expected = head.reference().logits_over(tokens)
    config = ModelConfig.from_dir(head.target)
    target = load_model(config, head.target, torch.float32)
    model, head_config = head.load(target, config, head.directory, torch.float32, "cpu")
    groups = cache_groups(head_config, torch.float32)
    caches = allocate_caches(groups, head_config.num_layers, CacheSizes(8, 0), 4, "cpu")
    got = []
    for first, last, metadata in prefill_then_decode(len(tokens) - 1):
        next_tokens = torch.tensor(tokens[first + 1 : last + 1])
        entries = torch.arange(first, last)
        out = model(next_tokens, entries, caches, metadata, features[first:last])
        got.append(model.compute_logits(out))
    torch.testing.assert_close(torch.cat(got), expected, atol=1e-4, rtol=0)


PROMPTS = [list(range(10, 31)), [5, 6, 7] * 5, list(range(100, 137))]
PARAMS = [greedy(n) for n in (14, 9, 11)]


class Run(NamedTuple):
    tokens: list[list[int]]
    proposals: list[tuple[list[int], list[int]]]  # (the tokens it was made from, drafts)
    costs: list[tuple[int, int]]  # per proposal: (head steps it ran, most drafts)
    seen: Any  # the probe's records


def speculative_run(
    head: Head, monkeypatch, token_budget: int = 1024, num_speculative_tokens: int = 2, **args
) -> Run:
    """Three greedy prompts with the head, recording every proposal."""
    args |= dict(block_size=4, num_kv_blocks=256, max_num_batched_tokens=token_budget)
    proposals, costs, engines = [], [], []
    propose = HeadProposer.propose

    def spy(self, inputs, output, drafting):
        before = sum(engines[0].stats().draft_steps.values())
        drafts = propose(self, inputs, output, drafting)
        for request, _ in drafting:
            if request.request_id in drafts:
                proposals.append((list(request.token_ids), drafts[request.request_id].token_ids))
        depth = max((len(d.token_ids) for d in drafts.values()), default=0)
        costs.append((sum(engines[0].stats().draft_steps.values()) - before, depth))
        return drafts

    with monkeypatch.context() as patch:  # spies on this run only
        patch.setattr(HeadProposer, "propose", spy)
        llm = probed(
            head.target, num_speculative_tokens=num_speculative_tokens, **args, **head.args
        )
        engines.append(llm.engine)
        got = llm.generate(PROMPTS, PARAMS)
    stats = llm.engine.stats()
    assert stats.speculative.rounds > 0 and stats.kv_blocks_used == 0
    return Run(token_ids(got), proposals, costs, records(llm))


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
@pytest.mark.parametrize("token_budget", [1024, 12], ids=["whole-prefill", "chunked-prefill"])
def test_drafts_are_the_reference_drafts_and_keep_greedy_output(
    head, token_budget, enforce_eager, monkeypatch
):
    """Every proposal, at every step, equals the reference head's drafts from the same
    tokens over the whole sequence (so the head's cache holds what a full forward
    computes, prefill chunks included); greedy output equals greedy without the head.
    With graphs on, the head's steps replay captured graphs."""
    run = speculative_run(head, monkeypatch, token_budget, enforce_eager=enforce_eager)
    args = dict(block_size=4, num_kv_blocks=256, max_num_batched_tokens=token_budget)
    assert run.tokens == token_ids(LLM(head.target, **args).generate(PROMPTS, PARAMS))
    assert len(run.proposals) > 10
    assert bool(run.seen.replays("head")) != enforce_eager
    reference = head.reference()
    for tokens, drafts in run.proposals:
        assert drafts == reference.drafts(tokens, len(drafts)), len(tokens)


def stale(name: str, graph: str = "head") -> Callable:
    return lambda monkeypatch: forget_refresh(monkeypatch, name, graph)


HEAD_INPUTS = ("hidden_states", "block_table", "slot_mapping", "positions", "seq_lens")
MUTATIONS = {
    **{name: stale(name) for name in HEAD_INPUTS},
    "first-draft-row": first_draft_from_the_row_before,
    **{
        f"loop-{name}": stale(name, "head draft loop")
        for name in ("input_ids", "hidden_states", "block_table", "positions", "draft_limits")
    },
}


@pytest.mark.parametrize("mutation", [None, *MUTATIONS])
def test_a_head_graph_that_reads_a_stale_input_is_caught(one_head_each, mutation, monkeypatch):
    """With graphs, the head's cache and every proposal equal the eager run's; a replay
    that keeps its hidden states, block table, slots, positions or lengths from an
    earlier step (in the mirror's and draft steps' graphs, or in the draft loop's), or a
    first draft read from the wrong row, leaves other rows or drafts other tokens."""
    eager = speculative_run(one_head_each, monkeypatch, enforce_eager=True)
    if mutation is not None:
        MUTATIONS[mutation](monkeypatch)
    graphs = speculative_run(one_head_each, monkeypatch)
    assert graphs.seen.replays("head")
    live = slice(0, -1)  # the spare last slot takes padded rows' writes
    mine, theirs = graphs.seen.kv_caches("head")[0], eager.seen.kv_caches("head")[0]
    difference = (mine[live] - theirs[live]).abs().max().item()
    same = graphs.proposals == eager.proposals
    if mutation is None:
        assert difference < 1e-4 and same
    else:
        assert difference > 1e-3 or not same, f"{mutation} went unnoticed"


def test_a_mixed_batch_of_16_keeps_greedy_output_and_acceptance_with_graphs(head):
    """Greedy output with the head equals greedy output without, eager and with graphs;
    and the acceptance per draft position with graphs equals eager's."""
    prompts = [list(range(10, 30)) + [i, i + 1] * (i % 3 + 1) for i in range(40, 56)]
    params = [greedy(n) for n in (20, 7, 13, 25) * 4]
    args = dict(block_size=4, num_kv_blocks=512)
    plain = token_ids(LLM(head.target, **args).generate(prompts, params))
    metrics = {}
    for enforce_eager in (True, False):
        llm = LLM(
            head.target,
            num_speculative_tokens=3,
            enforce_eager=enforce_eager,
            **args,
            **head.args,
        )
        assert token_ids(llm.generate(prompts, params)) == plain
        stats = llm.engine.stats()
        assert stats.speculative.rounds > 0 and stats.kv_blocks_used == 0
        assert ("graph" in stats.draft_steps) != enforce_eager, stats.draft_steps
        metrics[enforce_eager] = (stats.speculative.proposed, stats.speculative.accepted)
    assert metrics[True] == metrics[False]


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
def test_the_first_draft_costs_no_head_step_of_its_own(one_head_each, enforce_eager, monkeypatch):
    """The mirror's output at each request's newest entry is what the first draft reads:
    a proposal of d drafts runs the mirror and d - 1 draft steps, no more (one by one, or
    inside the captured draft loop)."""
    run = speculative_run(
        one_head_each, monkeypatch, num_speculative_tokens=3, enforce_eager=enforce_eager
    )
    assert any(depth == 3 for _, depth in run.costs)
    for steps, depth in run.costs:
        assert steps == max(depth, 1), run.costs
