"""Context parallelism over worker processes (gloo and shared memory on the CPU): prefill
context parallelism (PCP) splits long prefills over ranks, decode context parallelism
(DCP) splits every context's KV over tensor-parallel ranks, and either, alone or with
tensor parallelism, computes what one process computes: the same greedy tokens, logits
within 1e-4, eager and with graphs.

The draft model runs whole on rank 0, over the step rank 0 built for the whole batch
(global block tables, slots, seq_lens, positions): the tests below watch its captured
graphs' buffers and show that each way of feeding it a rank's local view is caught."""

from __future__ import annotations

import json
import signal
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import torch

from tests.conftest import make_tiny_checkpoint
from tests.probes import LogitsProbe, assert_idle
from tests.serving import MODEL, running_server, start_server_process, wait_for_idle
from tests.test_speculative import greedy, self_drafting, skip_refresh, token_ids, token_prompts
from updraft import LLM, WorkerPool
from updraft.demo import DEMO_DRAFT_DIR, DEMO_MODEL_DIR
from updraft.speculative.draft_model import DraftModel
from updraft.step.inputs import capture_inputs
from updraft.step.prefill_split import split_step, splits

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


@pytest.fixture(scope="module")
def pool():
    """The module's worker processes: each engine's other ranks run on them, one engine
    after another, instead of on processes of its own."""
    workers = WorkerPool()
    yield workers
    workers.close()


def run(checkpoint, prompts=PROMPTS, params=PARAMS, **args):
    """(engine, tokens, the logits each token was drawn from); the engine's other ranks
    are stopped (back in the pool) before it returns."""
    llm = LLM(str(checkpoint), **{**ARGS, **args})
    probe = LogitsProbe(llm)
    outputs = llm.generate(prompts, params)
    assert_idle(llm)
    llm.engine.close()
    return llm, token_ids(outputs), [probe.of(output) for output in outputs]


def assert_same(ours, reference) -> None:
    _, tokens, logits = ours
    _, expected_tokens, expected_logits = reference
    assert tokens == expected_tokens
    for mine, theirs in zip(logits, expected_logits, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=0)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def one_process(request, tmp_path_factory):
    """A tiny model and what one process computes on it: Llama (GQA, 2 KV heads) and
    Qwen3 (4 KV heads, q/k norms)."""
    checkpoint = make_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
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
        ours = run(tiny_llama, prompts, params, **tight, worker_pool=pool, **LAYOUTS[layout])
        assert_same(ours, plain)


def test_decode_context_ranks_keep_every_other_position(tiny_llama, pool):
    """Under DCP=2 a position x lives on rank x mod 2: rank 0's cache holds half the
    positions one process's does, and the pool counts twice the tokens per block."""
    prompt, steps = list(range(10, 31)), 14  # writes positions 0..33
    filled = []
    for layout in ({"tensor_parallel_size": 2}, LAYOUTS["tp2-dcp2"]):
        llm = LLM(str(tiny_llama), pool, **ARGS, enforce_eager=True, **layout)
        llm.generate([prompt], [greedy(steps)])
        keys = llm.engine._runner.kv_caches[0][0][:-1]  # the spare slot takes slot -1
        filled.append(int((keys.abs().sum(dim=(1, 2)) != 0).sum()))
        assert llm.engine._scheduler.kv.block_size == 4 * layout.get(
            "decode_context_parallel_size", 1
        )
        llm.engine.close()
    assert filled == [34, 17]


def test_sizes_that_cannot_split_are_refused(tiny_llama):
    with pytest.raises(ValueError, match="decode_context_parallel_size 2 must divide"):
        LLM(str(tiny_llama), decode_context_parallel_size=2)
    with pytest.raises(ValueError, match="prefill_context_parallel_size must be an int >= 1"):
        LLM(str(tiny_llama), prefill_context_parallel_size=0)
    with pytest.raises(ValueError, match="'mtp' reads the target's embedding"):
        LLM(speculative_method="mtp", prefill_context_parallel_size=2)


# -- the draft model under PCP ------------------------------------------------------------

DRAFT_PARAMS = [greedy(n) for n in (20, 9, 14, 3, 17, 12)]


def draft_graph_watch(llm: LLM) -> list[dict]:
    """Record, after every replay of the draft model's graphs, its static input buffers:
    their addresses and contents, and the step that filled them."""
    seen: list[dict] = []
    for graph, _ in llm.engine._proposer.runner.captured.graphs.values():
        replay = graph.replay

        def watch(step, graph=graph, replay=replay):
            out = replay(step)
            buffers = {i.name: i.buffer for i in graph.inputs}
            seen.append(
                {
                    "pointers": {name: b.data_ptr() for name, b in buffers.items()},
                    "buffers": {name: b.clone() for name, b in buffers.items()},
                    "request_ids": list(step.request_ids),
                    "num_reqs": step.num_reqs,
                    "num_tokens": step.num_tokens,
                }
            )
            return out

        graph.replay = watch
    return seen


def check_buffers(seen: list[dict], block_size: int) -> None:
    """Addresses never change; each token's slot is its position's in its request's
    block-table row; padded slots are -1 and padded rows are reset."""
    assert len({tuple(sorted(s["pointers"].items())) for s in seen}) == 1
    crossed = padded = changed = False
    for before, record in zip([None, *seen], seen, strict=False):
        b, tokens, reqs = record["buffers"], record["num_tokens"], record["num_reqs"]
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
        changed |= before is not None and before["request_ids"] != record["request_ids"]
    assert crossed and padded and changed  # the run exercised what it claims to


def draft_run(checkpoint, pool, **args):
    """Self-drafting (every greedy draft must be accepted) at batch 6, with requests
    finishing at different steps, under PCP=2 with graphs on."""
    llm = self_drafting(
        checkpoint,
        enforce_eager=False,
        max_num_batched_tokens=32,
        worker_pool=pool,
        **LAYOUTS["pcp2"],
        **args,
    )
    seen = draft_graph_watch(llm)
    outputs = token_ids(llm.generate(token_prompts(6), DRAFT_PARAMS))
    return llm, outputs, seen


def test_the_draft_model_reads_the_global_step_under_pcp(tiny_llama, pool):
    plain = token_ids(LLM(str(tiny_llama), **ARGS).generate(token_prompts(6), DRAFT_PARAMS))
    single = self_drafting(tiny_llama, enforce_eager=False, max_num_batched_tokens=32)
    single.generate(token_prompts(6), DRAFT_PARAMS)
    llm, outputs, seen = draft_run(tiny_llama, pool)
    assert outputs == plain
    metrics = llm.engine.stats().speculative
    assert metrics.acceptance_rate == 1.0, metrics.summary()
    assert metrics.accepted == single.engine.stats().speculative.accepted
    assert any("split over 2 ranks" in mode for mode in llm.engine.stats().steps)
    check_buffers(seen, block_size=4)
    # A padded-only run leaves nothing of the last batch behind, and the engine goes on.
    runner = llm.engine._proposer.runner
    (size, query_len), (graph, _) = next(iter(runner.captured.graphs.items()))
    with torch.inference_mode():
        graph.replay(capture_inputs(size * query_len, size, runner.captured.max_blocks))
    buffers = {i.name: i.buffer for i in graph.inputs}
    assert (buffers["slot_mapping"] == -1).all() and (buffers["block_table"] == 0).all()
    assert (buffers["seq_lens"] == 0).all()
    again = token_ids(llm.generate(token_prompts(6), DRAFT_PARAMS))
    assert again == plain
    assert llm.engine.stats().speculative.acceptance_rate == 1.0
    llm.engine.close()


def test_the_draft_model_under_dcp_keeps_every_position_itself(tiny_llama, pool):
    """Under DCP=2 the target's blocks hold 8 positions (4 per rank); the draft model,
    whole on rank 0, pages through the same block ids with blocks of 8: every draft
    is still accepted."""
    llm = self_drafting(tiny_llama, enforce_eager=False, worker_pool=pool, **LAYOUTS["tp2-dcp2"])
    outputs = token_ids(llm.generate(token_prompts(6), DRAFT_PARAMS))
    plain = token_ids(LLM(str(tiny_llama), **ARGS).generate(token_prompts(6), DRAFT_PARAMS))
    assert outputs == plain
    assert llm.engine._proposer.runner.positions_per_block == 8
    assert llm.engine.stats().speculative.acceptance_rate == 1.0
    llm.engine.close()


def local_mirror(propose, local):
    def propose_on(self, inputs, output, drafting):
        return propose(self, local(inputs), output, drafting)

    return propose_on


def rank0_chunks(inputs):
    """What rank 0 alone runs of a split step: its own chunks, local slots."""
    return split_step(inputs, 0, 2, 4).local if splits(inputs, 4) else inputs


def local_seq_lens(inputs):
    """Context lengths as one decode-context rank of two counts them."""
    return replace(inputs, seq_lens=(inputs.seq_lens + 1) // 2)


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
        skip_refresh(monkeypatch, mutation.removeprefix("refresh-"))
    else:
        local = rank0_chunks if mutation == "local-step" else local_seq_lens
        monkeypatch.setattr(DraftModel, "propose", local_mirror(DraftModel.propose, local))
    llm, _, seen = draft_run(tiny_llama, pool)
    caught = llm.engine.stats().speculative.acceptance_rate < 0.9
    if mutation.startswith("refresh-"):
        with pytest.raises(AssertionError):
            check_buffers(seen, block_size=4)
    assert caught, llm.engine.stats().speculative.summary()
    llm.engine.close()


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


def test_the_server_over_pcp_and_tp_answers_like_one_process():
    """``updraft serve`` over 4 ranks (PCP=2 x TP=2): a long prompt's completion, plain
    and streamed, is one process's text; SIGTERM stops the workers and removes their
    shared memory."""
    body = {
        "model": MODEL,
        "prompt": "The quick brown fox jumps over the lazy dog. " * 12,
        "max_tokens": 16,
        "temperature": 0,
    }
    with running_server() as base_url:
        expected = httpx.post(f"{base_url}/v1/completions", json=body).json()
    process, base_url = start_server_process(
        "--tensor-parallel-size", "2", "--prefill-context-parallel-size", "2"
    )
    try:
        plain = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60).json()
        streamed = []
        with httpx.stream(
            "POST", f"{base_url}/v1/completions", json={**body, "stream": True}, timeout=60
        ) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    streamed.append(json.loads(line.removeprefix("data: "))["choices"][0]["text"])
        wait_for_idle(base_url)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)
    assert plain["choices"][0]["text"] == expected["choices"][0]["text"]
    assert "".join(streamed) == expected["choices"][0]["text"]
    assert process.returncode == 0
    assert not list(Path("/dev/shm").glob(f"updraft-{process.pid}-*"))


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
        latent = ours[0].engine._runner.kv_caches[0][:-1]  # the spare slot takes slot -1
        written = int((latent.abs().sum(dim=1) != 0).sum())
        # Each request wrote positions 0..n-2 of its n tokens; rank 0 keeps the even ones.
        lengths = [len(p) + len(t) for p, t in zip(PROMPTS, ours[1], strict=True)]
        assert written == sum(n // 2 for n in lengths)
