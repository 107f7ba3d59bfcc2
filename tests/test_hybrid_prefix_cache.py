"""Prefix caching for a hybrid model: a cached prefix is resumed from the recurrent state
stored at its last block (engine/prefix_states.py).

The scheduler's side is checked against a model of the state itself: each slot row
holds the tokens whose state it is, steps write rows by the row rule of
``models/delta_rule.py`` and apply the step's state copies first, and every query must
start from the state after exactly the tokens before it, through random arrivals with
shared prefixes, aborts, finishes, preemptions, prefix states overwritten and
speculative drafts. The engine's side runs the tiny Qwen3.5 checkpoint: a hit computes
fewer tokens and gives the tokens of a run without the cache, eager and captured; a
hit that skipped its state copy gives other tokens.
"""

from __future__ import annotations

import random
from typing import NamedTuple

import pytest
import torch

from tests.checkpoints import saved_model
from tests.helpers import greedy, token_ids
from tests.mutations import skip_state_restores
from tests.probes import logits_of, probed, records
from updraft import LLM, SamplingParams
from updraft.attention.cache_groups import CacheSizes, cache_groups, split_budget
from updraft.engine.kv_blocks import BlockPool, KVCacheManager
from updraft.engine.prefix_states import PrefixStates
from updraft.engine.scheduler import Scheduler
from updraft.engine.state_slots import StateSlots
from updraft.engine.stats import EngineStats
from updraft.model_config import ModelConfig
from updraft.request import FinishReason, Request
from updraft.runner.rank_messages import step_message
from updraft.step.inputs import ALL_GRAPH_INPUTS, StepInputs
from updraft.step.output import StepOutput
from updraft.step.plan import Draft, ScheduledRequest, StateCopy, StepPlan

BLOCK = 4


class StateModel:
    """What a hybrid model's state tensors hold, as the token prefix each row is the
    state after: ``rows[slot, row]``."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.rows: dict[tuple[int, int], tuple[int, ...]] = {}

    def copy(self, copy: StateCopy) -> None:
        self.rows[copy.dst_slot, copy.dst_row] = self.rows.get((copy.src_slot, copy.src_row))

    def run(self, request: Request, start: int, tokens: list[int]) -> None:
        """A query from ``start``: it reads the row of the token before it (nothing
        from position 0) and must find the state after exactly the tokens before it."""
        slot, depth = request.state_slot, self.depth
        state = () if start == 0 else self.rows.get((slot, (start - 1) % depth))
        assert state == tuple(request.token_ids[:start]), (request.request_id, start)
        end = start + len(tokens)
        if len(tokens) > depth:  # a prefill chunk: only its final state
            self.rows[slot, (end - 1) % depth] = state + tuple(tokens)
            return
        for position, token in enumerate(tokens, start):
            state = (*state, token)
            self.rows[slot, position % depth] = state


def simulate(seed: int, k: int, prefix_slots: int) -> PrefixStates:
    """Random steps of a scheduler over a hybrid model's state, checked by
    ``StateModel``; returns the prefix states (every request ends, nothing leaks)."""
    rng = random.Random(seed)
    depth = 1 + k
    pool = BlockPool(24, BLOCK)
    slots = StateSlots(3)
    prefix = PrefixStates(slots.num_slots, prefix_slots, depth)
    scheduler = Scheduler(
        KVCacheManager(pool, prefix_states=prefix),
        max_num_seqs=3,
        max_num_batched_tokens=rng.choice([6, 11, 32]),
        max_model_len=64,
        num_lookahead_tokens=k,
        state_slots=slots,
    )
    model = StateModel(depth)
    heads = [[rng.randrange(1, 9) for _ in range(rng.randrange(4, 20))] for _ in range(3)]
    drafts: dict[str, Draft] = {}
    for index in range(40):
        head = rng.choice(heads)
        prompt = head[: rng.randrange(1, len(head) + 1)] + [rng.randrange(1, 9)] * rng.randrange(3)
        params = SamplingParams(max_tokens=rng.randrange(1, 8), ignore_eos=True)
        scheduler.add(Request(str(index), None, prompt, params))
        for _ in range(rng.randrange(3)):
            drafts = step(scheduler, model, drafts, rng)
        if rng.random() < 0.1 and scheduler.running:
            scheduler.finish(rng.choice(scheduler.running), FinishReason.ABORT)
    while scheduler.has_unfinished:
        drafts = step(scheduler, model, drafts, rng)
    assert pool.num_free == pool.num_blocks and slots.num_free == slots.num_slots
    return prefix


def step(
    scheduler: Scheduler, model: StateModel, drafts: dict[str, Draft], rng: random.Random
) -> dict[str, Draft]:
    plan = scheduler.schedule(drafts)
    for copy in plan.state_copies:
        model.copy(copy)
    sampled, tokens, accepted = [], [], []
    for item in plan.scheduled:
        request = item.request
        start = request.num_computed_tokens
        known = request.token_ids[start : start + item.num_new_tokens - item.num_drafts]
        draft = [] if item.draft is None else item.draft.token_ids
        model.run(request, start, known + draft)
        if item.samples:
            count = rng.randrange(len(draft) + 1)
            sampled.append(request.request_id)
            tokens.append([*draft[:count], rng.randrange(1, 9)])
            accepted.append(count)
    scheduler.update(plan, StepOutput(sampled, tokens, accepted, None, None, 0.0, "fake"))
    return {
        request.request_id: Draft([rng.randrange(1, 9) for _ in range(limit)])
        for request, limit in scheduler.drafting()
    }


@pytest.mark.parametrize("k", [0, 2], ids=["plain", "speculative"])
@pytest.mark.parametrize("prefix_slots", [1, 6])
def test_every_query_starts_from_the_state_after_its_prefix(k, prefix_slots):
    hits = sum(simulate(seed, k, prefix_slots).num_hits for seed in range(12))
    assert hits > 0, "no prefix state was ever hit"


def test_a_dropped_save_or_restore_is_caught_by_the_state_model(monkeypatch):
    """The state model sees a hit that resumed from a slot nobody filled, and a state
    stored from the wrong row."""
    with monkeypatch.context() as patch:
        patch.setattr(
            PrefixStates, "restore", lambda self, key, slot, start: StateCopy(slot, 0, slot, 0)
        )
        with pytest.raises(AssertionError):
            for seed in range(12):
                simulate(seed, 0, 6)
    save = PrefixStates.save
    monkeypatch.setattr(
        PrefixStates, "save", lambda self, key, slot, end: save(self, key, slot, end + 1)
    )
    with pytest.raises(AssertionError):
        for seed in range(12):
            simulate(seed, 2, 6)


def test_prefill_is_cut_at_the_last_full_block_and_its_state_saved_then_restored():
    prefix = PrefixStates(first_slot=2, num_slots=1, depth=1)
    kv = KVCacheManager(BlockPool(16, BLOCK), prefix_states=prefix)
    scheduler = Scheduler(kv, 2, 100, 64, state_slots=StateSlots(2))
    prompt = list(range(1, 12))  # 11 tokens: the last full block ends at 8
    scheduler.add(Request("a", None, prompt, SamplingParams(max_tokens=1)))
    plan = scheduler.schedule()
    assert [item.num_new_tokens for item in plan.scheduled] == [8]
    assert plan.state_copies == []
    scheduler.update(plan, StepOutput([], [], [], None, None, 0.0, "fake"))
    scheduler.add(Request("b", None, [*prompt[:8], 50, 51], SamplingParams(max_tokens=1)))
    plan = scheduler.schedule()
    # the save (a's slot 0, row 0, into prefix slot 2) first, then b's restore
    assert plan.state_copies == [StateCopy(0, 0, 2, 0), StateCopy(2, 0, 1, 0)]
    assert [(i.request.request_id, i.num_new_tokens) for i in plan.scheduled] == [
        ("a", 3),
        ("b", 2),
    ]
    assert prefix.num_hits == 1


def test_an_overwritten_prefix_state_is_a_miss():
    """One prefix slot: b's state overwrites a's, so a prompt going on from a's finds
    a's blocks still cached but no state to resume from, and computes everything."""
    prefix = PrefixStates(first_slot=1, num_slots=1, depth=1)
    kv = KVCacheManager(BlockPool(16, BLOCK), prefix_states=prefix)
    scheduler = Scheduler(kv, 1, 100, 64, state_slots=StateSlots(1))
    first, second = list(range(1, 10)), list(range(20, 29))
    for request_id, prompt in (("a", first), ("b", second)):
        scheduler.add(Request(request_id, None, prompt, SamplingParams(max_tokens=1)))
        while scheduler.has_unfinished:
            plan = scheduler.schedule()
            sampled = [item.request.request_id for item in plan.scheduled if item.samples]
            tokens = [[7] for _ in sampled]
            scheduler.update(plan, StepOutput(sampled, tokens, [0] * len(sampled), *NO_EXTRAS))
    after_a, after_b = (
        Request(i, None, [*p, 3], SamplingParams()) for i, p in (("c", first), ("d", second))
    )
    assert len(kv.pool.lookup([kv.block_key(after_a, n) for n in (1, 2)])) == 2
    assert kv.cached_prefix(after_a) == []
    assert len(kv.cached_prefix(after_b)) == 2


NO_EXTRAS = (None, None, 0.0, "fake")


def test_a_prefix_computed_again_takes_over_the_keys_of_its_free_blocks():
    """A request that computes a prefix whose blocks are cached but free (a hybrid
    model's, when the state there was overwritten) registers its own blocks under
    their keys: evicting the old ones later leaves the prefix findable."""
    pool = BlockPool(6, BLOCK)
    kv = KVCacheManager(pool)
    prompt = list(range(1, 11))
    for request_id in "ab":
        request = Request(request_id, None, prompt, SamplingParams())
        assert kv.allocate(request, 10)
        request.num_computed_tokens = 10
        kv.register_computed(request)
        blocks = request.block_ids[:2]
        if request_id == "a":
            kv.free(request)
    pool.allocate(pool.num_free)  # evicts a's free blocks
    assert kv.cached_prefix(Request("c", None, prompt, SamplingParams())) == blocks


def test_a_steps_state_copies_reach_its_inputs_and_the_other_ranks():
    """Plain host data beside the forward's inputs: in the step's inputs and in the
    message each other rank runs the same forward from, never a graph input."""
    request = Request("a", None, list(range(1, 10)), SamplingParams())
    request.block_ids, request.state_slot = [0, 1, 2], 0
    copies = [StateCopy(0, 0, 2, 0), StateCopy(3, 0, 1, 0)]
    plan = StepPlan([ScheduledRequest(request, 9)], state_copies=copies)
    inputs = StepInputs.build(plan, BLOCK)
    assert inputs.state_copies == tuple(copies)
    assert step_message("target", inputs, None).inputs.state_copies == tuple(copies)
    assert "state_copies" not in {spec.name for spec in ALL_GRAPH_INPUTS}
    assert StepInputs.build(StepPlan([ScheduledRequest(request, 9)]), BLOCK).state_copies == ()


def test_prefix_states_are_paid_for_out_of_the_state_half_of_the_budget(qwen35):
    _, directory = qwen35
    groups = cache_groups(ModelConfig.from_dir(directory), torch.float32)
    per_slot = groups[-1].bytes_per_slot
    budget = 20 * per_slot
    default = split_budget(groups, budget, BLOCK, max_num_seqs=64, prefix_states=None)
    assert (default.num_state_slots, default.num_prefix_states) == (5, 5)
    assert split_budget(groups, budget, BLOCK, 64, prefix_states=3) == CacheSizes(
        split_budget(groups, budget, BLOCK, 64, 0).num_blocks, 7, 3
    )
    with pytest.raises(ValueError, match=r"no recurrent-state slot .* beside 10 prefix states"):
        split_budget(groups, budget, BLOCK, 64, prefix_states=10)


# -- through the engine -------------------------------------------------------------------

ENGINE = {"block_size": 8, "max_num_batched_tokens": 48}
GRAPHS = {"enforce_eager": False, "capture_sizes": (1, 2, 4), "compile_graphs": False}
MAX_TOKENS = 8
TOLERANCE = 2e-4


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3.5-prefix")
    return saved_model("qwen3.5", directory), directory


def conversation(seed: int = 0) -> tuple[list[int], list[list[int]]]:
    """A first prompt, and prompts that go on from it (later turns of its chat)."""
    generator = torch.Generator().manual_seed(seed)
    # 73 tokens: its last full block ends at its last token, so the step that
    # computes that token is a verify step under speculation, which writes every row
    # of the slot, the saved one too, after the save.
    first = torch.randint(1, 256, (73,), generator=generator).tolist()
    later = [first + torch.randint(1, 256, (n,), generator=generator).tolist() for n in (5, 13)]
    return first, later


class Run(NamedTuple):
    tokens: list[list[int]]  # greedy, of conversation()'s prompts in order
    logits: list[torch.Tensor]  # the rows the later prompts' tokens were drawn from
    computed: int  # tokens the target's forwards computed
    stats: EngineStats


def run_conversation(directory, **engine) -> Run:
    """The first prompt, then the later ones together."""
    first, later = conversation()
    llm = probed(str(directory), **ENGINE, **engine)
    outputs = llm.generate([first], [greedy(MAX_TOKENS)])
    outputs += llm.generate(later, [greedy(MAX_TOKENS)] * 2)
    stats = llm.engine.stats()
    seen = records(llm)
    return Run(
        token_ids(outputs),
        [logits_of(seen, output) for output in outputs[1:]],
        sum(step.num_tokens for step in seen.steps_of("target")),
        stats,
    )


@pytest.fixture(scope="module")
def expected(qwen35) -> Run:
    """Without the prefix cache."""
    return run_conversation(qwen35[1], enforce_eager=True, enable_prefix_caching=False)


def assert_same_logits(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for rows, expected_rows in zip(got, expected, strict=True):
        torch.testing.assert_close(rows, expected_rows, atol=TOLERANCE, rtol=0)


MODES = {
    "eager": {"enforce_eager": True},
    "graphs": GRAPHS,
    "draft-is-target": {**GRAPHS, "num_speculative_tokens": 3},
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_hit_resumes_from_the_stored_state_and_computes_fewer_tokens(qwen35, expected, mode):
    """Both later prompts resume from the first prompt's state at its last full block:
    their tokens and logits are those of a run without the cache. A draft model (the
    target itself) resumes from its own stored state: every draft is accepted."""
    engine = dict(MODES[mode])
    if mode == "draft-is-target":
        engine["speculative_model"] = str(qwen35[1])
    got = run_conversation(qwen35[1], **engine)
    assert got.tokens == expected.tokens
    assert_same_logits(got.logits, expected.logits)
    stats = got.stats
    assert stats.prefix_states.hits == 2 and stats.prefix_states.total == stats.state_slots_total
    assert stats.state_slots_used == 0 and stats.kv_blocks_used == 0
    if mode != "eager":
        assert stats.steps["graph"] > 0
    if mode == "draft-is-target":
        metrics = stats.speculative
        assert metrics.num_accepted_tokens == metrics.num_draft_tokens > 0
        return
    first, _ = conversation()
    cached = (len(first) - 1) // 8 * 8  # the first prompt's last full block
    assert got.computed == expected.computed - 2 * cached


def test_a_hit_that_skips_its_state_copy_is_caught(qwen35, expected, monkeypatch):
    """The later prompts then resume from whatever their slot held (the first
    prompt's state after its last token, or nothing): their logits move by far more
    than the tolerance. (This tiny model's state fades fast, so its greedy tokens
    over a few steps do not change: the logits are what tells.)"""
    skip_state_restores(monkeypatch)
    got = run_conversation(qwen35[1], enforce_eager=True)
    assert got.stats.prefix_states.hits == 2
    for rows, expected_rows in zip(got.logits, expected.logits, strict=True):
        assert (rows - expected_rows).abs().max() > 50 * TOLERANCE


def test_preemption_abort_and_n_sequences_keep_the_tokens(qwen35, expected):
    """Few blocks: requests are preempted, and go on from the saved states; an
    aborted request's save still lands (the later prompts resume from it); the n
    sequences of one request find the first's state. Nothing is left held."""
    _, directory = qwen35
    first, later = conversation()
    llm = LLM(str(directory), **ENGINE, enforce_eager=True, num_kv_blocks=13, max_num_seqs=2)
    engine = llm.engine
    aborted = engine.add_request(first, greedy(50))
    for _ in range(2):  # its prompt's last full block, then its state saved
        engine.step()
    engine.abort(aborted)
    hits = engine.stats().prefix_states.hits
    outputs = llm.generate(later, [greedy(MAX_TOKENS)] * 2)
    assert token_ids(outputs) == expected.tokens[1:]
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    stats = engine.stats()
    assert stats.prefix_states.hits > hits
    params = SamplingParams(n=3, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    hits = stats.prefix_states.hits
    (family,) = llm.generate([first], params)
    assert [c.token_ids for c in family.outputs] == expected.tokens[:1] * 3
    stats = engine.stats()
    # the first sequence's state at its last block was overwritten: it computes its
    # prompt again, and the others resume from the state it stores
    assert stats.prefix_states.hits >= hits + 2
    assert stats.state_slots_used == 0 and stats.kv_blocks_used == 0
