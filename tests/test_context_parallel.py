"""Context parallelism over worker processes (gloo and shared memory on the CPU): prefill
context parallelism (PCP) splits long prefills over ranks, decode context parallelism
(DCP) splits every context's KV over tensor-parallel ranks, and either, alone or with
tensor parallelism, computes what one process computes: the same greedy tokens, logits
within 1e-4, eager and with graphs.

The draft model runs whole on rank 0, over the step rank 0 built for the whole batch
(global block tables, slots, seq_lens, positions): the tests below watch its captured
graphs' buffers, and the target's on rank 1, through the runner probe, and show that
each way of feeding the draft a rank's local view is caught."""

from __future__ import annotations

import pytest
import torch

from tests.checkpoints import build_checkpoint
from tests.helpers import greedy, token_ids, token_prompts
from tests.mutations import draft_mirror_on, forget_refresh, local_seq_lens, rank0_chunks
from tests.probes import assert_idle, logits_of, probe_dir, probed, records
from tests.test_speculative import self_drafting
from updraft import LLM
from updraft.demo import DEMO_DRAFT_DIR, DEMO_MODEL_DIR

# Prompts shorter than 2P chunks (1 and 3 tokens), ending mid-block and crossing block
# boundaries (block size 4), and longer than the chunked-prefill budget below.
PROMPTS = [
    list(range(10, 31)),
    [5, 6, 7] * 5,
    list(range(100, 137)),
    list(range(1, 60)),
    [3],
    [9, 8, 7],
]
PARAMS = [greedy(n) for n in (14, 9, 11, 6, 7, 8)]
ARGS = dict(block_size=4, num_kv_blocks=256, max_num_batched_tokens=32)

LAYOUTS = {
    "pcp2": dict(prefill_context_parallel_size=2),
    "tp2-dcp2": dict(tensor_parallel_size=2, decode_context_parallel_size=2),
    "tp2-pcp2": dict(tensor_parallel_size=2, prefill_context_parallel_size=2),
}


def run(checkpoint, prompts=PROMPTS, params=PARAMS, **args):
    """(engine, tokens, the logits each token was drawn from, the probe's records); the
    engine's other ranks are stopped (back in the pool) before it returns."""
    llm = probed(str(checkpoint), **{**ARGS, **args})
    outputs = llm.generate(prompts, params)
    assert_idle(llm)
    seen = records(llm)
    return llm, token_ids(outputs), [logits_of(seen, output) for output in outputs], seen


def assert_same(ours, reference) -> None:
    _, tokens, logits, _ = ours
    _, expected_tokens, expected_logits, _ = reference
    assert tokens == expected_tokens
    for mine, theirs in zip(logits, expected_logits, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=0)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def one_process(request, tmp_path_factory):
    """A tiny model and what one process computes on it: Llama (GQA, 2 KV heads) and
    Qwen3 (4 KV heads, q/k norms)."""
    checkpoint = build_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    return checkpoint, run(checkpoint)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_ranks_compute_what_one_process_computes(one_process, layout, pool):
    checkpoint, reference = one_process
    ours = run(checkpoint, worker_pool=pool, **LAYOUTS[layout])
    assert_same(ours, reference)
    steps = ours[0].engine.stats().steps
    assert "graph" in steps, steps
    split = any("split over 2 ranks" in mode for mode in steps)
    assert split == ("pcp2" in layout), steps


@pytest.mark.parametrize("layout", ["pcp2", "tp2-dcp2"])
def test_eager_steps_compute_what_one_process_computes(tiny_llama, layout, pool):
    reference = run(tiny_llama, enforce_eager=True)
    ours = run(tiny_llama, enforce_eager=True, worker_pool=pool, **LAYOUTS[layout])
    assert_same(ours, reference)


def test_prefix_caching_and_preemption_under_both(tiny_llama, pool):
    """A later prompt reuses cached blocks that hold an earlier request's generated
    tokens (computed in decode steps, which no rank splits) and then splits its own
    prefill over them; a cache of 24 blocks forces preemption."""
    first = list(range(20, 60))
    reference = LLM(str(tiny_llama), **ARGS).generate([first], [greedy(12)])
    second = first + token_ids(reference)[0] + list(range(60, 90))
    prompts = [first, second, *PROMPTS[:4]]
    params = [greedy(12), greedy(10), *PARAMS[:4]]
    tight = dict(num_kv_blocks=24, block_size=4)
    plain = run(tiny_llama, prompts, params, **tight)
    for layout in ("pcp2", "tp2-dcp2"):
        ours = run(
            tiny_llama,
            prompts,
            params,
            **tight,
            worker_pool=pool,
            **LAYOUTS[layout],
        )
        assert_same(ours, plain)


def test_decode_context_ranks_keep_every_other_position(tiny_llama, pool):
    """Under DCP=2 a position x lives on rank x mod 2: each rank's cache holds half the
    positions one process's does (rank 0 the even ones, rank 1 the odd ones), and the
    pool counts twice the tokens per block."""
    prompt, steps = list(range(10, 31)), 14  # writes positions 0..33
    filled = {}
    for name, layout in (("tp2", {"tensor_parallel_size": 2}), ("tp2-dcp2", LAYOUTS["tp2-dcp2"])):
        llm = probed(str(tiny_llama), worker_pool=pool, **ARGS, enforce_eager=True, **layout)
        llm.generate([prompt], [greedy(steps)])
        assert llm.engine.stats().positions_per_block == 4 * layout.get(
            "decode_context_parallel_size", 1
        )
        seen = records(llm)
        for rank in (0, 1):
            keys = seen.kv_caches(rank=rank)[0][0][:-1]  # the spare slot takes slot -1
            filled[name, rank] = int((keys.abs().sum(dim=(1, 2)) != 0).sum())
    assert filled == {("tp2", 0): 34, ("tp2", 1): 34, ("tp2-dcp2", 0): 17, ("tp2-dcp2", 1): 17}


def test_sizes_that_cannot_split_are_refused(tiny_llama):
    with pytest.raises(ValueError, match="decode_context_parallel_size 2 must divide"):
        LLM(str(tiny_llama), decode_context_parallel_size=2)
    with pytest.raises(ValueError, match="prefill_context_parallel_size must be an int >= 1"):
        LLM(str(tiny_llama), prefill_context_parallel_size=0)


# -- the draft model under PCP ------------------------------------------------------------

DRAFT_PARAMS = [greedy(n) for n in (20, 9, 14, 3, 17, 12)]


def check_buffers(replays: list, block_size: int, exercised: bool = True) -> None:
    """Over a runner's replays (the probe's records): addresses never change; each
    token's slot is its position's in its request's block-table row (of ``block_size``
    positions per block); padded slots are -1 and padded rows are reset. With
    ``exercised``, the replays must also have crossed block boundaries, changed batches
    and replayed a bucket larger than its batch."""
    assert replays
    assert len({tuple(sorted(r.pointers.items())) for r in replays}) == 1
    crossed = padded = changed = False
    for before, record in zip([None, *replays], replays, strict=False):
        b, tokens, reqs = record.buffers, record.num_tokens, record.num_reqs
        starts = b["query_start_loc"][: reqs + 1]
        owner = torch.searchsorted(starts[1:], torch.arange(tokens), right=True)
        positions = b["positions"][:tokens]
        blocks = b["block_table"][owner, positions // block_size]
        assert torch.equal(b["slot_mapping"][:tokens], blocks * block_size + positions % block_size)
        assert (b["slot_mapping"][tokens:] == -1).all()
        assert (b["block_table"][reqs:] == 0).all() and (b["seq_lens"][reqs:] == 0).all()
        ends = positions[starts[1:] - 1]
        assert torch.equal(b["seq_lens"][:reqs], ends + 1)
        crossed |= bool(((positions % block_size == 0) & (positions > 0)).any())
        padded |= reqs < b["seq_lens"].numel()
        changed |= before is not None and before.request_ids != record.request_ids
    assert (crossed and padded and changed) or not exercised  # what the run exercised


def draft_run(checkpoint, pool, layout="pcp2", **args):
    """Self-drafting (every greedy draft must be accepted) at batch 6, with requests
    finishing at different steps, with graphs on, every rank's steps probed. -> (the
    engine, its tokens, the probe's records)."""
    llm = self_drafting(
        checkpoint,
        probe=probe_dir(),
        enforce_eager=False,
        max_num_batched_tokens=32,
        worker_pool=pool,
        **LAYOUTS[layout],
        **args,
    )
    outputs = token_ids(llm.generate(token_prompts(6), DRAFT_PARAMS))
    return llm, outputs, records(llm)


def test_the_draft_model_reads_the_global_step_under_pcp(tiny_llama, pool):
    """Rank 0's draft graphs and rank 1's target graphs alike read the global step: its
    block tables, slots, lengths and positions, refreshed at every replay."""
    plain = token_ids(LLM(str(tiny_llama), **ARGS).generate(token_prompts(6), DRAFT_PARAMS))
    single = self_drafting(tiny_llama, enforce_eager=False, max_num_batched_tokens=32)
    single.generate(token_prompts(6), DRAFT_PARAMS)
    llm, outputs, seen = draft_run(tiny_llama, pool)
    assert outputs == plain
    metrics = llm.engine.stats().speculative
    assert metrics.acceptance_rate == 1.0, metrics.summary()
    assert metrics.accepted == single.engine.stats().speculative.accepted
    assert any("split over 2 ranks" in mode for mode in llm.engine.stats().steps)
    check_buffers(seen.replays("draft", rank=0), block_size=4)
    # Rank 1 runs every step rank 0 runs, the same way; where it replays, its buffers
    # hold the same global step as rank 0's.
    ours, theirs = seen.steps_of("target", rank=0), seen.steps_of("target", rank=1)
    assert [(s.mode, s.buffers.keys()) for s in theirs] == [
        (s.mode, s.buffers.keys()) for s in ours
    ]
    assert any("split over 2 ranks" in step.mode for step in theirs)
    for mine, other in zip(ours, theirs, strict=True):
        assert all(torch.equal(other.buffers[n], b) for n, b in mine.buffers.items())
    check_buffers(seen.replays("target", rank=1), block_size=4, exercised=False)
    assert not seen.steps_of("draft", rank=1)  # the draft runs on rank 0 alone


def test_the_draft_model_under_dcp_keeps_every_position_itself(tiny_llama, pool):
    """Under DCP=2 the target's blocks hold 8 positions (4 per rank); the draft model,
    whole on rank 0, pages through the same block ids with blocks of 8: every draft
    is still accepted."""
    llm, outputs, seen = draft_run(tiny_llama, pool, layout="tp2-dcp2")
    plain = token_ids(LLM(str(tiny_llama), **ARGS).generate(token_prompts(6), DRAFT_PARAMS))
    assert outputs == plain
    check_buffers(seen.replays("draft"), block_size=8)
    assert llm.engine.stats().speculative.acceptance_rate == 1.0


MIRROR_VIEWS = {"local-step": rank0_chunks, "local-seq": local_seq_lens}


@pytest.mark.parametrize(
    "mutation",
    ["refresh-block_table", "refresh-slot_mapping", "refresh-seq_lens", "local-step", "local-seq"],
)
def test_each_way_of_feeding_the_draft_a_local_view_is_caught(
    tiny_llama, monkeypatch, mutation, pool
):
    """The checks of the test above fail when a draft graph stops refreshing its block
    table, slots or seq_lens, or when the draft's mirror step runs on rank 0's chunks
    (local slots and seq_lens) or on per-rank context lengths."""
    if mutation.startswith("refresh-"):
        forget_refresh(monkeypatch, mutation.removeprefix("refresh-"), "draft")
    else:
        draft_mirror_on(monkeypatch, MIRROR_VIEWS[mutation])
    llm, _, seen = draft_run(tiny_llama, pool)
    caught = llm.engine.stats().speculative.acceptance_rate < 0.9
    if mutation.startswith("refresh-"):
        with pytest.raises(AssertionError):
            check_buffers(seen.replays("draft"), block_size=4)
    assert caught, llm.engine.stats().speculative.summary()


def test_pcp_with_a_draft_model_serves_like_one_process(pool):
    """The demo model and its draft model, graphs on: requests one at a time, 16 at
    once, and a prompt longer than max_num_batched_tokens, as one process serves them."""
    args = dict(
        speculative_model=str(DEMO_DRAFT_DIR),
        num_speculative_tokens=3,
        max_num_batched_tokens=64,
        capture_sizes=(1, 2, 4, 8, 16),
    )
    prompts = token_prompts(16, seed=5)
    long = list(range(1, 200))
    results = []
    for layout in ({}, LAYOUTS["pcp2"]):
        llm = LLM(str(DEMO_MODEL_DIR), pool, **args, **layout)
        alone = [token_ids(llm.generate([p], [greedy(10)]))[0] for p in prompts[:3]]
        together = token_ids(llm.generate(prompts, [greedy(12)] * 16))
        longest = token_ids(llm.generate([long], [greedy(16)]))
        stats = llm.engine.stats()
        results.append((alone, together, longest, stats.speculative.accepted))
        assert_idle(llm)
        if layout:
            assert any("split over 2 ranks" in mode for mode in stats.steps)
            llm.engine.close()
    assert results[0] == results[1]
    assert sum(results[1][3]) > 0


@pytest.mark.parametrize("layout", ["tp2-pcp2", "tp2-dcp2"])
def test_deepseek_latent_attention_and_experts_split_like_one_process(tiny_deepseek, layout, pool):
    """V2, V3 (with and without a query LoRA) and V3.2 (DSA, top 6 of each context):
    heads split over the tensor ranks, experts' rows too, the router and indexer whole
    on every rank. With PCP the latent rows of a split prefill are gathered per layer;
    with DCP each rank's latent cache keeps every other position, and V3.2's top-k is
    taken over every rank's index scores."""
    _, checkpoint = tiny_deepseek
    ours = run(checkpoint, worker_pool=pool, **LAYOUTS[layout])
    assert_same(ours, run(checkpoint))
    if layout == "tp2-dcp2":
        # One request alone, so that no block it writes was another's (a finished
        # request's last block is handed out again first): it wrote positions 0..n-2 of
        # its n tokens, and rank 0 keeps the even ones. The spare slot takes slot -1.
        prompt, params = PROMPTS[3], PARAMS[3]
        alone = run(checkpoint, [prompt], [params], worker_pool=pool, **LAYOUTS[layout])
        latent = alone[3].kv_caches(rank=0)[0][:-1]
        written = int((latent.abs().sum(dim=1) != 0).sum())
        assert written == (len(prompt) + len(alone[1][0])) // 2
