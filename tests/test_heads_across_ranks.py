"""Proposers whose model runs on every rank of a split target: EAGLE (GQA) on tiny
Llama and Qwen3 and DeepSeek's MTP layer on tiny V3 (MLA) and V3.2 (DSA), split over two
tensor ranks (with or without DCP), replicated across two prefill-context ranks, or
both, and a draft model split over two tensor ranks (and replicated across two
prefill-context ranks). Every step each runner runs, on every rank, is handed
exactly the step one process hands it (so every proposal, which the target's verify
steps carry, is one process's), greedy output equals decoding without speculation, and
acceptance per draft position equals one process's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from contextlib import contextmanager
from functools import cache, partial
from pathlib import Path

import pytest
import torch

from tests.checkpoints import build_checkpoint
from tests.conftest import add_byte_tokenizer
from tests.heads import Head, make_head
from tests.helpers import greedy, token_ids
from tests.mutations import RANK_MUTATIONS, on_other_ranks
from tests.probes import probed, records
from tests.serving import (
    completion_texts,
    free_port,
    metric,
    running_server,
    start_server_process,
)
from updraft import LLM, SamplingParams, WorkerPool
from updraft.config import EngineConfig, ParallelSizes
from updraft.engine.engine import Engine
from updraft.model_config import ModelConfig
from updraft.models.layers import DecoderLayer
from updraft.models.loader import building, load_model
from updraft.models.registry import model_class
from updraft.models.tensor_parallel import shard_model
from updraft.parallel import shared_memory
from updraft.parallel.topology import RankPlace
from updraft.runner.probe import ProbeRecords
from updraft.serve.serving import ServeSettings

LAYOUTS = {
    "tp2": dict(tensor_parallel_size=2),
    "pcp2": dict(prefill_context_parallel_size=2),
    "tp2-dcp2": dict(tensor_parallel_size=2, decode_context_parallel_size=2),
    "pcp2-tp2": dict(prefill_context_parallel_size=2, tensor_parallel_size=2),
}


def world(layout: str) -> int:
    sizes = LAYOUTS[layout]
    return sizes.get("tensor_parallel_size", 1) * sizes.get("prefill_context_parallel_size", 1)


# Six requests through at most four sequences at a time, prompts prefilled in chunks
# (some split over the prefill-context ranks): requests join and leave between replays.
PROMPTS = [list(range(10, 31)), [5, 6, 7] * 5, list(range(100, 137)), [9] * 7, [3, 4] * 9, [8]]
PARAMS = [greedy(n) for n in (14, 9, 11, 6, 12, 8)]
ARGS = dict(
    block_size=4,
    num_kv_blocks=256,
    max_num_seqs=4,
    max_num_batched_tokens=24,
    capture_sizes=(1, 4),
    num_speculative_tokens=2,
)


HEADS = ["eagle-llama", "eagle-qwen3", "mtp", "mtp-dsa"]
# One head per attention kind: GQA, MLA, DSA.
KINDS = ["eagle-llama", "mtp", "mtp-dsa"]


@pytest.fixture(scope="module")
def head(request, tmp_path_factory) -> Head:
    """The head named by the test's (indirect) parameter."""
    return make_head(request.param, tmp_path_factory.mktemp(f"{request.param}-ranks"))


@pytest.fixture(scope="module")
def draft_pair(tmp_path_factory) -> Head:
    """A tiny Llama target and a draft model of its shape, as a Head's target and args."""
    root = tmp_path_factory.mktemp("draft-ranks")
    target = build_checkpoint("llama", root / "target", seed=0)
    draft = build_checkpoint("llama", root / "draft", seed=1)
    args = {"speculative_model": str(draft), "draft_tensor_parallel_size": 2}
    return Head(target, args, None, draft, None)


ONE_PROCESS: dict[str, tuple[list, object, ProbeRecords]] = {}


def one_process(
    proposer: Head, layout: str, graph_mode: str, requests: int
) -> tuple[list, object, ProbeRecords]:
    """(tokens, acceptance, probe records) of the proposer in one process over the first
    ``requests`` prompts, with the layout's positions per block (the same block tables
    and slots) and graph mode; run once for the layouts that share them."""
    block_size = ARGS["block_size"] * LAYOUTS[layout].get("decode_context_parallel_size", 1)
    key = f"{proposer.target} {proposer.args} {block_size} {graph_mode} {requests}"
    if key not in ONE_PROCESS:
        args = {**ARGS, **proposer.args, "draft_tensor_parallel_size": 1}
        llm = probed(proposer.target, **{**args, "block_size": block_size}, **modes(graph_mode))
        prompts, params = PROMPTS[:requests], PARAMS[:requests]
        tokens = token_ids(llm.generate(prompts, params))
        assert tokens == no_speculation(proposer.target, block_size, requests)  # exact
        ONE_PROCESS[key] = tokens, llm.engine.stats().speculative, records(llm)
    return ONE_PROCESS[key]


@cache
def no_speculation(target: Path, block_size: int, requests: int) -> list:
    """Greedy tokens of the first ``requests`` prompts without speculation."""
    plain = LLM(target, **{**ARGS, "block_size": block_size})
    return token_ids(plain.generate(PROMPTS[:requests], PARAMS[:requests]))


def modes(graph_mode: str) -> dict:
    """Engine arguments for ``graph_mode``: ``auto``, ``full``, ``piecewise`` or
    ``eager``."""
    return {"enforce_eager": True} if graph_mode == "eager" else {"graph_mode": graph_mode}


def handed(seen: ProbeRecords, runner: str, rank: int = 0) -> list[tuple]:
    """Each step the runner ran on the rank: its requests and tensors as handed to it."""
    return [
        (step.request_ids, {name: t.tolist() for name, t in step.inputs.items()})
        for step in seen.steps_of(runner, rank)
    ]


def assert_handed_alike(got: list[tuple], expected: list[tuple], where: tuple) -> None:
    """The same steps: request ids and integer tensors equal, hidden states to 1e-4
    (each rank's own)."""
    assert len(got) == len(expected), where
    for index, ((ids, tensors), (expected_ids, expected_tensors)) in enumerate(
        zip(got, expected, strict=True)
    ):
        assert ids == expected_ids, (*where, index)
        assert tensors.keys() == expected_tensors.keys(), (*where, index)
        for field, values in expected_tensors.items():
            if field == "hidden_states":
                torch.testing.assert_close(
                    torch.tensor(tensors[field]), torch.tensor(values), atol=1e-4, rtol=0
                )
            else:
                assert tensors[field] == values, (*where, index, field)


def assert_every_rank_runs_one_process_s_steps(
    proposer: Head,
    runner: str,
    layout: str,
    pool,
    graph_mode: str = "auto",
    requests: int = len(PROMPTS),
) -> ProbeRecords:
    """Over the first ``requests`` prompts -> the run's probe records."""
    tokens, acceptance, alone = one_process(proposer, layout, graph_mode, requests)
    args = {**ARGS, **proposer.args, **LAYOUTS[layout], **modes(graph_mode)}
    llm = probed(proposer.target, **args, worker_pool=pool)
    assert token_ids(llm.generate(PROMPTS[:requests], PARAMS[:requests])) == tokens
    stats = llm.engine.stats()
    assert stats.speculative == acceptance and acceptance.rounds > 0
    seen = records(llm)
    for name in ("target", runner):
        for rank in range(world(layout)):
            assert_handed_alike(handed(seen, name, rank), handed(alone, name), (name, rank))
    # The proposer's steps replayed graphs on the other ranks too, which read what rank
    # 0's read, from buffers that never moved; rank 0 sent one message per forward
    # each other rank ran.
    for rank in range(1, world(layout)):
        assert bool(seen.replays(runner, rank)) == (graph_mode != "eager")
        for name in ("target", runner):
            pointers = {}
            for mine, theirs in zip(seen.replays(name), seen.replays(name, rank), strict=True):
                assert pointers.setdefault(theirs.bucket, theirs.pointers) == theirs.pointers
                assert mine.buffers.keys() == theirs.buffers.keys()
                for field, buffer in mine.buffers.items():
                    torch.testing.assert_close(theirs.buffers[field], buffer, atol=1e-4, rtol=0)
        forwards = len(seen.steps_of("target", rank)) + len(seen.steps_of(runner, rank))
        assert sum(stats.rank_messages.values()) == forwards
        for replay in seen.replays(runner, rank):
            assert_padded(replay)
        if graph_mode != "eager":  # some replay was padded
            assert any(r.num_reqs < r.bucket[0] for r in seen.replays(runner, rank))
    return seen


def assert_padded(replay) -> None:
    """A replay's padding, past its step's real rows: slots -1 (no KV written),
    block-table rows and seq_lens 0, and in a draft loop no drafts wanted."""
    buffers, tokens, requests = replay.buffers, replay.num_tokens, replay.num_reqs
    assert (buffers["block_table"][requests:] == 0).all()
    if replay.bucket[2]:  # the draft loop derives its slots and lengths in the graph
        assert (buffers["draft_limits"][requests:] == 0).all()
        return
    assert (buffers["slot_mapping"][tokens:] == -1).all()
    assert (buffers["seq_lens"][requests:] == 0).all()


@pytest.mark.parametrize(
    ("head", "layout"),
    [(kind, layout) for kind in KINDS for layout in LAYOUTS] + [("eagle-qwen3", "pcp2-tp2")],
    indirect=["head"],
)
def test_a_head_on_every_rank_runs_the_steps_one_process_runs(head, layout, pool):
    assert_every_rank_runs_one_process_s_steps(head, "head", layout, pool)


@pytest.mark.parametrize(
    ("head", "graph_mode"),
    [("eagle-llama", "piecewise"), ("mtp", "piecewise"), ("mtp-dsa", "full"), ("mtp", "eager")],
    indirect=["head"],
)
def test_each_attention_kind_s_head_runs_one_process_s_steps_in_each_graph_mode(
    head, graph_mode, pool
):
    """Under PCP=2, the graph mode auto does not pick for the kind (auto picks FULL for
    GQA and MLA here, PIECEWISE for DSA: the layouts test runs those), and eagerly:
    each rank's head replays step graphs of that mode only (its draft loop holds
    attention whole in every mode), from the steps one process runs in that mode."""
    seen = assert_every_rank_runs_one_process_s_steps(head, "head", "pcp2", pool, graph_mode)
    for rank in (0, 1):
        replays = seen.replays("head", rank)
        steps = {step.graph_mode for step in replays if not step.bucket[2] and step.bucket[1]}
        assert steps == ({graph_mode.upper()} if graph_mode != "eager" else set())
        loops = {step.graph_mode for step in replays if step.bucket[2]}
        assert loops == ({"FULL"} if graph_mode != "eager" else set())
        # Mixed buckets (query length 0: prefills) resolve attention per step in any mode.
        mixed = {step.graph_mode for step in replays if step.bucket[1] == 0}
        assert mixed <= {"PIECEWISE"}


@pytest.mark.parametrize("head", ["mtp"], indirect=True)
def test_prefix_caching_and_preemption_keep_one_process_s_drafts(head, pool):
    """Under PCP=2 x TP=2 a later prompt reuses an earlier request's cached blocks
    (generated tokens included) and splits its own prefill over them, and a cache of 24
    blocks preempts requests, whose head entries are then rewritten: one process's
    tokens and acceptance per position."""
    first = list(range(20, 60))
    args = {**ARGS, **head.args, "num_kv_blocks": 24, "max_num_batched_tokens": 32}
    runs = []
    for layout in ({}, {**LAYOUTS["pcp2-tp2"], "worker_pool": pool}):
        llm = probed(head.target, **args, **layout)
        earlier = token_ids(llm.generate([first], [greedy(12)]))[0]
        prompts = [first + earlier + list(range(60, 90)), *PROMPTS[:4]]
        outputs = llm.generate(prompts, [greedy(10), *PARAMS[:4]])
        runs.append((earlier, token_ids(outputs), llm.engine.stats().speculative))
        assert sum(output.metrics.num_preemptions for output in outputs) > 0
        # The later prompt's first step starts past the earlier request's cached blocks.
        later = outputs[0].request_id
        step = next(s for s in records(llm).steps_of("target") if later in s.request_ids)
        row = step.request_ids.index(later)
        assert step.inputs["positions"][step.inputs["query_start_loc"][row]] >= len(first)
    assert runs[1] == runs[0]


@pytest.mark.parametrize("head", ["eagle-llama", "mtp"], indirect=True)
def test_sampled_drafts_reach_every_rank_as_rank_0_drew_them(head, pool):
    """Seeded sampling at temperature 0.8 under TP=2: rank 0 alone draws drafts (its
    generators never leave it), and every step rank 1 runs, the head's draft steps
    included, carries exactly the tokens rank 0's does."""
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=10) for i in range(len(PROMPTS))]
    llm = probed(head.target, **ARGS, **head.args, tensor_parallel_size=2, worker_pool=pool)
    llm.generate(PROMPTS, params)
    assert llm.engine.stats().speculative.rounds > 0
    seen = records(llm)
    for name in ("target", "head"):
        assert_handed_alike(handed(seen, name, 1), handed(seen, name), (name, 1))
    # Sampled drafts are drafted step by step (no greedy draft loop).
    assert not [step for step in seen.steps_of("head") if step.bucket and step.bucket[2]]


# This module's worker pools, so that the tests that start processes of their own can
# close them first (``idle_pools_closed``).
OPEN_POOLS: list[WorkerPool] = []


@pytest.fixture(scope="module")
def pool(pool):
    OPEN_POOLS.append(pool)
    return pool


@pytest.fixture
def idle_pools_closed():
    """The module's pools closed before a test that starts its own processes (torchrun
    nodes, a server's ranks): their idle workers, some 340 MB each, would sit beside
    them, and the suite's two workers share 4 GB. A later test that takes workers from a
    closed pool starts them again."""
    for idle in OPEN_POOLS:
        idle.close()


@pytest.fixture(scope="module")
def mutated(tmp_path_factory):
    """(a worker pool whose workers install every ``RANK_MUTATIONS`` entry, a function
    that turns one on for a ``with`` block): rank 0 applies none."""
    switch = tmp_path_factory.mktemp("switch") / "mutation"
    pool = WorkerPool(initializer=partial(on_other_ranks, str(switch)))
    OPEN_POOLS.append(pool)

    @contextmanager
    def on(name: str):
        switch.write_text(name)
        try:
            yield pool
        finally:
            switch.unlink()

    yield on
    for worker in pool.workers:
        worker.process.kill()
    pool.close()


WRONG_INPUTS = [name for name in RANK_MUTATIONS if "head step" not in name]


@pytest.mark.parametrize("head", KINDS, indirect=True)
def test_with_every_mutation_off_the_mutated_pool_runs_one_process_s_steps(head, mutated):
    """The control for the tests below: the same check on the same workers passes
    while no mutation is on, so each failure below is its mutation's."""
    with mutated("none") as pool:
        assert_every_rank_runs_one_process_s_steps(head, "head", "pcp2", pool, requests=4)


@pytest.mark.parametrize("head", KINDS, indirect=True)
@pytest.mark.parametrize("mutation", WRONG_INPUTS)
def test_a_wrong_input_on_another_rank_alone_is_caught(head, mutation, mutated):
    """Under PCP the head on rank 1 feeds nothing back to rank 0, whose tokens cannot
    show a bug there: rank 1's head graphs that stop refreshing one input, a head fed
    its rank's chunks or their context lengths, and hidden states not gathered or out
    of step order each fail the check that rank 1 ran one process's steps."""
    with mutated(mutation) as pool, pytest.raises(AssertionError):
        assert_every_rank_runs_one_process_s_steps(head, "head", "pcp2", pool, requests=4)


@pytest.mark.parametrize("head", ["mtp"], indirect=True)
@pytest.mark.parametrize("how", ["exit", "hang"])
def test_a_rank_that_dies_or_hangs_in_a_head_step_is_named(head, how, mutated, monkeypatch):
    """Under TP=2 the head's collectives wait for rank 1: a rank 1 that exits in the
    head's first step is named as exited, and one that hangs there as stuck once the
    step timeout passes (shortened here), instead of rank 0 waiting forever."""
    # Shortened, but not below what loading and capture on a busy machine may keep a
    # healthy rank away from a collective (the region takes it when the engine starts).
    monkeypatch.setattr(shared_memory, "STEP_TIMEOUT_MS", 10_000)
    with mutated(f"{how} in a head step") as pool:
        llm = LLM(head.target, **ARGS, **head.args, tensor_parallel_size=2, worker_pool=pool)
        named = "exited" if how == "exit" else "rank 1 .* within 10 s: it is alive but stuck"
        with pytest.raises(RuntimeError, match=named):
            llm.generate(PROMPTS[:2], PARAMS[:2])
        for worker in pool.workers:  # the one that hangs
            if worker.busy:
                worker.process.kill()
                worker.process.join()
        with pytest.raises(RuntimeError, match="exited"):
            llm.generate(PROMPTS[:1], PARAMS[:1])
        llm.engine.close()


@pytest.mark.parametrize("layout", ["tp2", "tp2-dcp2", "pcp2-tp2"])
def test_a_draft_model_split_over_tensor_ranks_runs_the_steps_one_process_runs(
    draft_pair, layout, pool
):
    assert_every_rank_runs_one_process_s_steps(draft_pair, "draft", layout, pool)


def layer_bytes(layer: torch.nn.Module) -> int:
    """Bytes of a decoder layer's attention and MLP (or experts), as this rank holds them."""
    parts = [layer.self_attn, layer.mlp]
    return sum(t.numel() * t.element_size() for part in parts for t in part.state_dict().values())


@pytest.mark.parametrize("head", KINDS, indirect=True)
@pytest.mark.parametrize("rank", [0, 1])
def test_a_head_holds_what_shard_model_keeps_of_a_target_layer_of_its_kind(head, rank):
    """Under TP=2, each rank's head layer is as large as one target layer of the same
    kind that ``shard_model`` split (bfloat16, so that no linear is repacked), and half
    of what it is whole (less what stays whole on every rank)."""
    place = RankPlace(rank, ParallelSizes(tensor=2), "unused")
    config = ModelConfig.from_dir(head.target)
    dtype = torch.bfloat16
    target = load_model(config, head.target, dtype)
    whole, _ = head.load(target, config, head.directory, dtype, "cpu")
    split_target = load_model(config, head.target, dtype, place=place)
    split, head_config = head.load(split_target, config, head.directory, dtype, "cpu", place)
    (layer,) = [module for module in split.body.modules() if isinstance(module, DecoderLayer)]
    if head_config.mla is not None:  # MTP: the target's own layers with experts
        reference = split_target.model.layers[-1]
    else:  # EAGLE: a Llama layer of the head's own config
        with building(dtype, "cpu"):
            model = model_class(head_config)(head_config)
        model.load_state_dict({name: torch.randn_like(t) for name, t in model.state_dict().items()})
        shard_model(model, place)
        reference = model.model.layers[0]
    assert layer_bytes(layer) == layer_bytes(reference)
    (whole_layer,) = [m for m in whole.body.modules() if isinstance(m, DecoderLayer)]
    assert layer_bytes(whole_layer) / 2 <= layer_bytes(layer) < layer_bytes(whole_layer)


def mtp_tokens(checkpoint: str, prefill_context_parallel_size: int) -> list[list[int]]:
    """Greedy tokens of two requests with MTP, in one process or (run by every torchrun
    rank; rank 1 runs its steps and exits inside ``LLM``) over prefill-context ranks."""
    speculation = {"speculative_method": "mtp", "num_speculative_tokens": 2}
    llm = LLM(checkpoint, **speculation, block_size=4, num_kv_blocks=128,
              prefill_context_parallel_size=prefill_context_parallel_size)  # fmt: skip
    outputs = llm.generate([list(range(10, 40)), [5, 6, 7] * 4], [greedy(12), greedy(7)])
    return token_ids(outputs)


TWO_NODE_SCRIPT = """
import json, sys
from tests.test_heads_across_ranks import mtp_tokens
print(json.dumps(mtp_tokens(sys.argv[1], 2)))
"""


@pytest.mark.usefixtures("idle_pools_closed")
def test_two_torchrun_nodes_over_loopback_give_one_process_s_tokens(tmp_path):
    """``torchrun --nnodes 2`` (one rank each, on this machine over loopback, so the
    ranks are not on one machine as far as they know and exchange through gloo, not
    shared memory): PCP = 2 with MTP gives one process's tokens."""
    checkpoint = make_head("mtp", tmp_path).target
    script = tmp_path / "two_nodes.py"
    script.write_text(TWO_NODE_SCRIPT)
    alone = mtp_tokens(str(checkpoint), 1)
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    torchrun = Path(sys.executable).with_name("torchrun")
    port = free_port()
    nodes = [
        subprocess.Popen(
            [
                str(torchrun),
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "--nproc-per-node",
                "1",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                str(script),
                str(checkpoint),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for node in (0, 1)
    ]
    results = [node.communicate(timeout=300) for node in nodes]
    for node, (_, stderr) in zip(nodes, results, strict=True):
        assert node.returncode == 0, stderr[-3000:]
    assert json.loads(results[0][0]) == alone and alone[0]
    assert results[1][0] == ""


SPEC_METRICS = ("draft", "accepted")


@pytest.mark.usefixtures("idle_pools_closed")
def test_the_server_with_mtp_over_pcp_and_tp_answers_like_one_process(tmp_path):
    """``updraft serve --speculative-method mtp`` over PCP=2 x TP=2 on a tiny DeepSeek
    (with a byte tokenizer; the prompt splits over the prefill-context ranks): a
    completion, plain and streamed, is one process's, with as many drafts offered and
    accepted; SIGTERM stops the workers and removes their shared memory."""
    checkpoint = add_byte_tokenizer(make_head("mtp", tmp_path).target)
    speculation = {"speculative_method": "mtp", "num_speculative_tokens": 2}
    cache = {"block_size": 4, "num_kv_blocks": 128}
    body = {"model": checkpoint.name, "prompt": "the quick brown fox " * 5, "max_tokens": 16}
    body |= {"temperature": 0, "ignore_eos": True}

    def served(base_url: str) -> tuple:
        texts = completion_texts(base_url, body)
        return texts, [
            metric(base_url, f"updraft_spec_decode_{kind}_tokens") for kind in SPEC_METRICS
        ]

    engine = Engine(EngineConfig(model=str(checkpoint), **speculation, **cache))
    with running_server(ServeSettings(model_name=checkpoint.name), engine) as base_url:
        (plain, streamed), accepted = served(base_url)
    args = [
        f"--{name.replace('_', '-')}={value}" for name, value in {**speculation, **cache}.items()
    ]
    process, base_url = start_server_process(
        "--model", str(checkpoint), *args,
        "--tensor-parallel-size", "2", "--prefill-context-parallel-size", "2",
    )  # fmt: skip
    try:
        split = served(base_url)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)
    assert process.returncode == 0
    assert plain == streamed and plain
    assert split == ((plain, streamed), accepted) and accepted[0] > 0  # drafts offered
    assert not list(Path("/dev/shm").glob(f"updraft-{process.pid}-*"))
