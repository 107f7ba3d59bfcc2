"""Tensor parallelism over worker processes (gloo on the CPU): two ranks compute what one
process computes, token for token and logit for logit, eager and with graphs."""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.checkpoints import build_checkpoint
from tests.helpers import greedy, token_ids
from tests.probes import assert_idle, logits_of, probed, records
from tests.test_qwen35_mtp import with_mtp
from updraft import LLM
from updraft.config import ParallelSizes
from updraft.demo import DEMO_DRAFT_DIR, DEMO_MODEL_DIR
from updraft.model_config import ModelConfig
from updraft.models.loader import load_model
from updraft.parallel.topology import RankPlace

# Prompts that end mid-block and cross block boundaries (block size 4), a repetitive
# one for prompt lookup, and one longer than the chunked-prefill budget below.
PROMPTS = [list(range(10, 31)), [5, 6, 7] * 5, list(range(100, 137)), list(range(1, 60))]
PARAMS = [greedy(n) for n in (14, 9, 11, 6)]
ARGS = dict(block_size=4, num_kv_blocks=256, max_num_batched_tokens=32)


def run(checkpoint, pool=None, **args):
    """Outputs and the logits each token was drawn from; the other ranks are back in
    ``pool`` when it returns."""
    llm = probed(str(checkpoint), worker_pool=pool, **ARGS, **args)
    outputs = llm.generate(PROMPTS, PARAMS)
    assert_idle(llm)
    seen = records(llm)
    return llm, outputs, [logits_of(seen, output) for output in outputs]


def assert_two_ranks_compute_like_one_process(checkpoint, pool, **args) -> None:
    """Greedy tokens identical, logits within 1e-4, over TP=2 and one process."""
    _, plain, plain_logits = run(checkpoint, **args)
    _, split, split_logits = run(checkpoint, pool, tensor_parallel_size=2, **args)
    assert token_ids(split) == token_ids(plain)
    for ours, reference in zip(split_logits, plain_logits, strict=True):
        torch.testing.assert_close(ours, reference, atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def odd_vocabulary(tmp_path_factory):
    """A Llama whose 257-token vocabulary does not split evenly over 2 ranks."""
    directory = tmp_path_factory.mktemp("odd_vocab")
    return build_checkpoint("llama-plain", directory, seed=3, vocab_size=257)


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
def test_two_ranks_compute_what_one_process_computes(tiny_checkpoint, enforce_eager, pool):
    """Llama (GQA, 2 KV heads: one per rank), Qwen2 (one KV head, kept by both ranks,
    tied embeddings, q/k/v bias) and Qwen3 (q/k norms): greedy tokens identical, logits
    within 1e-4, with chunked prefill over block boundaries."""
    _, checkpoint = tiny_checkpoint
    _, plain, plain_logits = run(checkpoint, enforce_eager=enforce_eager)
    llm, split, split_logits = run(
        checkpoint, pool, enforce_eager=enforce_eager, tensor_parallel_size=2
    )
    assert token_ids(split) == token_ids(plain)
    for ours, reference in zip(split_logits, plain_logits, strict=True):
        torch.testing.assert_close(ours, reference, atol=1e-4, rtol=0)
    steps = llm.engine.stats().steps
    assert ("graph" in steps) != enforce_eager, steps


def test_a_vocabulary_that_does_not_split_evenly(odd_vocabulary, pool):
    _, plain, plain_logits = run(odd_vocabulary)
    _, split, split_logits = run(odd_vocabulary, pool, tensor_parallel_size=2)
    assert token_ids(split) == token_ids(plain)
    for ours, reference in zip(split_logits, plain_logits, strict=True):
        assert ours.shape[-1] == 257
        torch.testing.assert_close(ours, reference, atol=1e-4, rtol=0)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculation_keeps_greedy_output_and_acceptance(method, pool):
    """The proposer runs on rank 0 only (the draft model unsplit); verify steps replay
    on every rank."""
    args = dict(speculative_method=method, num_speculative_tokens=3)
    if method == "draft":
        args["speculative_model"] = str(DEMO_DRAFT_DIR)
    prompts = [[10 + i, 11 + i, 12 + i] * 6 for i in range(6)]
    params = greedy(12)
    results = []
    for size in (1, 2):
        llm = LLM(str(DEMO_MODEL_DIR), pool, tensor_parallel_size=size, **args)
        outputs = llm.generate(prompts, params)
        stats = llm.engine.stats()
        results.append((token_ids(outputs), stats.speculative.accepted, stats.speculative.proposed))
        assert_idle(llm)
        llm.engine.close()
    assert results[0] == results[1]
    assert sum(results[1][1]) > 0


def rank_processes() -> list[multiprocessing.Process]:
    """The worker processes this process started for its engines' other ranks."""
    return [p for p in multiprocessing.active_children() if p.name.startswith("updraft-rank-")]


def test_a_closed_engine_stops_its_workers_and_a_dead_worker_is_named(tiny_llama):
    llm = LLM(str(tiny_llama), **ARGS, tensor_parallel_size=2)
    (worker,) = rank_processes()
    llm.generate(PROMPTS[:1], PARAMS[:1])
    worker.kill()
    worker.join()
    with pytest.raises(RuntimeError, match="updraft-rank-1 exited"):
        llm.generate(PROMPTS[:1], PARAMS[:1])
    llm.engine.close()
    other = LLM(str(tiny_llama), **ARGS, tensor_parallel_size=2)
    processes = rank_processes()
    assert len(processes) == 1
    other.engine.close()
    assert not any(p.is_alive() for p in processes)


def test_models_and_settings_tensor_parallelism_cannot_split_are_refused(tiny_llama):
    with pytest.raises(ValueError, match="does not divide this model's 4 attention heads"):
        LLM(str(tiny_llama), tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an int >= 1"):
        LLM(str(tiny_llama), tensor_parallel_size=0)
    draft = dict(speculative_model=str(tiny_llama), tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"draft_tensor_parallel_size must be 1 or .* got 3"):
        LLM(str(tiny_llama), **draft, draft_tensor_parallel_size=3)
    with pytest.raises(ValueError, match="draft_tensor_parallel_size is the draft model's"):
        LLM(str(tiny_llama), tensor_parallel_size=2, draft_tensor_parallel_size=2)


def test_shards_hold_their_rank_s_heads(tmp_path, pool):
    """Each rank's KV cache holds its own KV heads: 4 over 2 ranks is 2 per rank."""
    checkpoint = build_checkpoint("qwen3", tmp_path / "qwen3")
    llm = probed(str(checkpoint), worker_pool=pool, **ARGS, tensor_parallel_size=2)
    seen = records(llm)
    assert [seen.kv_caches(rank=rank)[0].shape[-2] for rank in (0, 1)] == [2, 2]
    for rank in (0, 1):
        place = RankPlace(rank, ParallelSizes(tensor=2), "unconnected")
        shard = load_model(ModelConfig.from_dir(checkpoint), checkpoint, torch.float32, place=place)
        assert shard.model.layers[0].self_attn.num_heads == 2


def test_torchrun_ranks_serve_one_engine(tiny_llama_with_tokenizer):
    """``torchrun --nproc-per-node 2 -m updraft generate ...``: rank 0 is the engine and
    prints the text; rank 1 runs its shard's steps and exits; the text is one
    process's."""
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [
        "-m",
        "updraft",
        "generate",
        "--model",
        str(tiny_llama_with_tokenizer),
        "--prompt",
        "hello",
        "--max-tokens",
        "12",
        "--temperature",
        "0",
        "--ignore-eos",
    ]
    alone = subprocess.run(
        [sys.executable, *command], capture_output=True, text=True, timeout=120, check=True
    )
    ranks = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node", "2", *command],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert ranks.returncode == 0, ranks.stderr[-3000:]
    assert ranks.stdout == alone.stdout
    assert alone.stdout.strip()


def process_lives(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def test_workers_exit_when_the_engine_process_is_killed(tiny_llama):
    """SIGKILL gives the engine no chance to stop its workers: each notices, in its
    wait for the next step, that rank 0's process is gone, and exits."""
    script = f"""
import multiprocessing, time
from updraft import LLM
if __name__ == "__main__":
    llm = LLM({str(tiny_llama)!r}, num_kv_blocks=16, tensor_parallel_size=2, enforce_eager=True)
    (worker,) = [p for p in multiprocessing.active_children() if p.name == "updraft-rank-1"]
    print(worker.pid, flush=True)
    time.sleep(600)
"""
    engine = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        worker = int(engine.stdout.readline())
        assert process_lives(worker)
    finally:
        engine.kill()
        engine.wait()
    deadline = time.monotonic() + 60
    while process_lives(worker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not process_lives(worker)


# -- GGUF files: each rank maps only its rows of the file ---------------------------------


def gguf_in_blocks(directory: Path, kind: str, mix: dict[str, str], **shape) -> Path:
    """A tiny checkpoint of ``kind`` written as GGUF with ``mix``'s tensor types."""
    from benchmarks.peers import make_gguf
    from tests.test_gguf import convert_to

    checkpoint = build_checkpoint(kind, directory / kind, **shape)
    path = directory / f"{kind}.gguf"
    make_gguf.main(checkpoint, path, convert_to(mix, np.random.default_rng(4), {}))
    return path


def held_bytes(model: torch.nn.Module) -> int:
    """The bytes of a GGUF model's weights, each tensor once (a tied head shares its
    table), the RoPE tables left out: blocks, panels and float tensors (norms, and
    biases, whole on every rank)."""
    held = {
        tensor.data_ptr(): tensor.numel() * tensor.element_size()
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]
        if "rotary" not in name
    }
    return sum(held.values())


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """name -> (checkpoint, the GGUF file llama.cpp's converter wrote from it, all in
    one of its processes); and ``qwen3-moe-blocks``: the Qwen3-MoE file with its
    experts' gate in Q4_1, up in Q5_0 and down in Q8_0 (block types that stay blocks),
    its other matrices in Q8_0."""
    from tests.llama_cpp_tree import convert_many, llama_cpp_tree
    from tests.test_gguf_deepseek import SIGMOID
    from tests.test_gguf_families import GEMMA3
    from tests.test_gguf_moe import ALL_ROUTED, _requantized

    llama_cpp_tree()
    # Gemma 3 as llama.cpp reads it, DeepSeek V3 with its sigmoid router, Qwen3-MoE with
    # every layer routed (as each family's own GGUF tests convert them) and experts 64
    # rows wide, so that a rank's 32 of down's inputs are one Q8_0 block.
    qwen3_moe = dict(num_hidden_layers=2, moe_intermediate_size=64, **ALL_ROUTED)
    converted = {  # name -> (tiny checkpoint, its changes, the converter's outtype)
        "llama-q8_0": ("llama-plain", {"vocab_size": 257}, "q8_0"),
        "phi4-mini": ("phi4-mini", {}, "f32"),
        "gemma3": ("gemma3", GEMMA3, "f32"),
        "deepseek-v3": ("deepseek-v3", SIGMOID, "f32"),
        "qwen3-moe": ("qwen3-moe", qwen3_moe, "f32"),
        "qwen3-moe-q8_0": ("qwen3-moe", qwen3_moe, "q8_0"),
    }
    root = tmp_path_factory.mktemp("gguf-tp")
    checkpoints, jobs, made = {}, [], {}
    for name, (kind, changes, outtype) in converted.items():
        if kind not in checkpoints:
            checkpoints[kind] = build_checkpoint(kind, root / kind, **changes)
        made[name] = (checkpoints[kind], root / f"{name}.gguf")
        jobs.append((*made[name], outtype))
    # Gemma's converter cuts the embedding to the tokenizer's size, read from here
    words = {"model": {"vocab": {str(i): i for i in range(256)}}, "added_tokens": []}
    (checkpoints["gemma3"] / "tokenizer.json").write_text(json.dumps(words))
    convert_many(jobs)
    (checkpoints["gemma3"] / "tokenizer.json").unlink()
    checkpoint, path = made["qwen3-moe"]
    blocks = {"gate": "Q4_1", "up": "Q5_0", "down": "Q8_0"}
    in_blocks = _requantized(path, root / "qwen3-moe-blocks.gguf", blocks, "Q8_0")
    made["qwen3-moe-blocks"] = (checkpoint, in_blocks)
    made["qwen3-moe-fused"] = (checkpoint, gate_up_fused(path, root / "qwen3-moe-fused.gguf"))
    return made


def gate_up_fused(path: Path, out: Path) -> Path:
    """``path`` with each layer's ``ffn_gate_exps`` and ``ffn_up_exps`` as one
    ``ffn_gate_up_exps`` [experts, gate rows then up rows, columns], as llama.cpp's
    converter writes some families' experts."""
    from gguf import GGUFReader

    from tests.test_gguf_deepseek import rewritten

    ups = {t.name: np.array(t.data) for t in GGUFReader(str(path)).tensors if "up_exps" in t.name}

    def fused(tensor):
        if "ffn_up_exps" in tensor.name:
            return []
        if "ffn_gate_exps" not in tensor.name:
            return None
        up = ups[tensor.name.replace("gate", "up")]
        rows = np.concatenate([np.array(tensor.data), up], axis=1)
        return [(tensor.name.replace("gate", "gate_up"), rows, tensor.tensor_type)]

    return rewritten(path, out, {}, fused)


def test_gguf_files_split_over_two_ranks_compute_what_one_process_computes(
    tmp_path, converted, pool
):
    """A float32 Llama with a 257-token vocabulary (its last shard padded) against the
    safetensors checkpoint it was written from; llama.cpp's converter's Q8_0 file of it
    (linears and the LM head in blocks that become panels, the embedding in blocks),
    eager and with graphs; a tied Qwen2 (one KV head, q/k/v bias) in K-quant blocks that
    stay blocks, its embedding and LM head one Q6_K table, with an F16 o_proj. Each at
    TP=2 gives one process's greedy tokens, and its logits within 1e-4."""
    from benchmarks.peers import make_gguf
    from updraft.models.gguf_loader import GGUFLinear
    from updraft.models.gguf_shards import VocabParallelBlocks
    from updraft.models.packed_linear import PackedLinear
    from updraft.models.tensor_parallel import VocabParallelEmbedding

    checkpoint, llama_q8_0 = converted["llama-q8_0"]
    llama_f32 = tmp_path / "llama-f32.gguf"
    make_gguf.main(checkpoint, llama_f32)
    # K-quants take rows of 256 values, and o_proj's and down_proj's are split: 512 wide
    mix = {"attn_output": "F16", "attn_v": "Q6_K", "ffn_down": "Q6_K", "token_embd": "Q6_K"}
    wide = dict(hidden_size=512, intermediate_size=1024)
    qwen2 = gguf_in_blocks(tmp_path, "qwen2", {**mix, "blk": "Q4_K"}, **wide)
    cases = [  # file, what one process runs, engine settings, the rank's embedding and head
        (llama_f32, checkpoint, EAGER, VocabParallelEmbedding, PackedLinear),
        (llama_q8_0, llama_q8_0, EAGER, VocabParallelBlocks, PackedLinear),
        (llama_q8_0, llama_q8_0, GRAPHS, VocabParallelBlocks, PackedLinear),
        (qwen2, qwen2, EAGER, VocabParallelBlocks, GGUFLinear),
    ]
    for path, reference, args, embedding, head in cases:
        model = assert_split_file_computes_like_one_process(path, reference, pool, args)
        assert isinstance(model.model.embed_tokens, embedding)
        assert isinstance(model.lm_head.linear, head)
        if path is not llama_f32:
            assert_rank_holds_about_half(model, path)


EAGER = dict(enforce_eager=True)
GRAPHS = dict(enforce_eager=False, capture_sizes=(4,), capture_tokens=(32,))


def assert_split_file_computes_like_one_process(path, reference, pool, args) -> torch.nn.Module:
    """``path`` at TP=2 gives the greedy tokens of ``reference`` in one process, and
    its logits within 1e-4; rank 0's model."""
    exact = {"activations": "float32", **args}  # the tolerance is float32's
    _, plain, plain_logits = run(reference, **exact)
    llm, split, split_logits = run(path, pool, tensor_parallel_size=2, **exact)
    assert token_ids(split) == token_ids(plain), path.name
    for ours, theirs in zip(split_logits, plain_logits, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    assert ("graph" in llm.engine.stats().steps) != args["enforce_eager"]
    return llm.engine._runner.model  # noqa: SLF001


def assert_rank_holds_about_half(model: torch.nn.Module, path: Path) -> None:
    from gguf import GGUFReader

    file_bytes = sum(int(t.n_bytes) for t in GGUFReader(str(path)).tensors)
    assert 0.45 * file_bytes < held_bytes(model) < 0.6 * file_bytes, path.name


def test_converted_gguf_families_split_over_two_ranks_compute_what_one_process_computes(
    converted, pool
):
    """Phi-4-mini (fused q/k/v and gate/up, partial rotary, tied), Gemma 3 (sliding and
    global layers), DeepSeek V3 (latent attention split by heads, routed and shared
    experts) and Qwen3-MoE in float32 against the checkpoints they were converted from;
    Qwen3-MoE's file with gate and up fused, against its checkpoint too; its Q8_0 file
    (experts in int8 panels, captured) and its file whose experts stay blocks, against
    themselves in one process. Every expert's rows split: a rank
    holds about half of each quantized file."""
    from updraft.models.gguf_experts import BlockExperts
    from updraft.models.moe import PackedExperts

    # file, whether one process runs its checkpoint (else the file), engine settings,
    # the ranks' routed experts
    cases = [
        ("phi4-mini", True, EAGER, None),
        ("gemma3", True, EAGER, None),
        ("deepseek-v3", True, EAGER, PackedExperts),
        ("qwen3-moe", True, EAGER, PackedExperts),
        ("qwen3-moe-fused", True, EAGER, PackedExperts),
        ("qwen3-moe-q8_0", False, GRAPHS, PackedExperts),
        ("qwen3-moe-blocks", False, EAGER, BlockExperts),
    ]
    for name, from_checkpoint, args, experts in cases:
        checkpoint, path = converted[name]
        reference = checkpoint if from_checkpoint else path
        model = assert_split_file_computes_like_one_process(path, reference, pool, args)
        held = [m for m in model.modules() if isinstance(m, PackedExperts | BlockExperts)]
        assert bool(held) == bool(experts) and all(isinstance(m, experts) for m in held), name
        if not from_checkpoint:
            assert_rank_holds_about_half(model, path)


def test_a_gguf_width_whose_share_is_not_whole_blocks_is_refused_with_the_numbers(tmp_path):
    """o_proj's 256 inputs in Q4_K blocks of 256: 128 per rank would cut every block; the
    engine refuses before any rank starts, and a rank's loader refuses alike."""
    wide = dict(hidden_size=256, intermediate_size=512)
    path = gguf_in_blocks(tmp_path, "llama-plain", {"blk": "Q4_K"}, **wide)
    message = (
        "blk.0.attn_output.weight: 256 inputs in Q4_K blocks of 256 cannot be split over 2 "
        "ranks: 128 each is not a whole number of blocks"
    )
    with pytest.raises(ValueError, match=message):
        LLM(str(path), tensor_parallel_size=2)
    assert not rank_processes()
    from updraft.checkpoints.local import local_checkpoint

    directory = local_checkpoint(str(path))
    place = RankPlace(1, ParallelSizes(tensor=2), "unconnected")
    with pytest.raises(ValueError, match=message):
        load_model(ModelConfig.from_dir(directory), directory, torch.float32, place=place)


# -- hybrid models: each rank keeps its share of the Gated DeltaNet heads and their state --
#
# Tiny random checkpoints (tests/checkpoints.py): 2 linear-attention key heads, each
# serving 2 value heads, so each rank keeps one key head and its two value heads; 4
# gated attention heads over 2 KV heads.

NGRAM = dict(speculative_method="ngram", num_speculative_tokens=3)


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory) -> Callable[[str], Path]:
    """kind -> its tiny checkpoint's directory, built when first asked for."""
    root = tmp_path_factory.mktemp("hybrid-tp")
    made = {}

    def checkpoint(kind: str):
        if kind not in made:
            build_checkpoint(kind, root / kind)
            made[kind] = root / kind
        return made[kind]

    return checkpoint


@pytest.mark.parametrize(
    ("kind", "args"),
    [
        ("qwen3.5", EAGER),
        ("qwen3.5", GRAPHS),
        ("qwen3-next", EAGER),
        ("qwen3-next", GRAPHS),
        ("qwen3.5-moe", EAGER),
        ("qwen3.5", {**GRAPHS, **NGRAM}),
    ],
    ids=["qwen3.5-eager", "qwen3.5-graphs", "next-eager", "next-graphs", "moe-eager", "ngram"],
)
def test_hybrid_models_split_over_two_ranks_compute_what_one_process_computes(
    hybrids, pool, kind, args
):
    """Qwen3.5 (fused q/k/v channels: three ranges per rank), Qwen3-Next (projections
    interleaved per key head; experts and a dense layer) and Qwen3.5-MoE: greedy tokens
    identical, logits within 1e-4; each rank's state rows hold its heads alone."""
    checkpoint = hybrids(kind)
    _, plain, plain_logits = run(checkpoint, **args)
    llm, split, split_logits = run(checkpoint, pool, tensor_parallel_size=2, **args)
    assert token_ids(split) == token_ids(plain)
    for ours, reference in zip(split_logits, plain_logits, strict=True):
        torch.testing.assert_close(ours, reference, atol=1e-4, rtol=0)
    stats = llm.engine.stats()
    assert ("graph" in stats.steps) != args["enforce_eager"], stats.steps
    if "speculative_method" in args:
        assert sum(stats.speculative.accepted) > 0
    config = ModelConfig.from_dir(checkpoint)
    linear = config.linear_attention
    conv_dim = (2 * linear.key_dim + linear.value_dim) // 2
    width = conv_dim * (linear.conv_kernel - 1) + linear.num_value_heads // 2 * (
        linear.key_head_dim * linear.value_head_dim
    )
    seen = records(llm)
    layer = min(config.linear_layers)
    assert [seen.kv_caches(rank=rank)[layer].shape[-1] for rank in (0, 1)] == [width, width]


def test_linear_attention_heads_that_do_not_divide_are_refused_by_name(hybrids, tmp_path):
    """One key head (serving 4 value heads) cannot be shared by two ranks."""
    raw = json.loads((hybrids("qwen3.5") / "config.json").read_text())
    raw["linear_num_key_heads"] = 1
    (tmp_path / "config.json").write_text(json.dumps(raw))
    message = (
        "tensor_parallel_size 2 does not divide this model's 1 linear-attention key heads "
        "and 4 value heads"
    )
    with pytest.raises(ValueError, match=message):
        LLM(str(tmp_path), tensor_parallel_size=2)


def test_quantization_groups_the_split_of_linear_attention_would_cut_are_refused(hybrids):
    """out_proj's 32 inputs (4 value heads of 8) are 16 per rank: half a group of 32."""
    message = r"groups of 32 columns would straddle .*the linear-attention out_proj \(16 columns"
    with pytest.raises(ValueError, match=message):
        LLM(
            str(hybrids("qwen3.5")),
            quantization="int4",
            quantization_group_size=32,
            tensor_parallel_size=2,
        )


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_a_hybrid_models_mtp_head_over_two_ranks_drafts_what_one_process_drafts(
    tmp_path, pool, eager
):
    """The MTP layer is split like a target layer (gated attention by heads): greedy
    tokens and logits equal one process's."""
    with_mtp("qwen3.5", tmp_path / "mtp")
    args = dict(
        speculative_method="mtp", num_speculative_tokens=2, enforce_eager=eager, capture_sizes=(4,)
    )
    _, plain, plain_logits = run(tmp_path / "mtp", **args)
    llm, split, split_logits = run(tmp_path / "mtp", pool, tensor_parallel_size=2, **args)
    assert token_ids(split) == token_ids(plain)
    for ours, reference in zip(split_logits, plain_logits, strict=True):
        torch.testing.assert_close(ours, reference, atol=1e-4, rtol=0)
    assert llm.engine.stats().speculative.rounds > 0


def test_a_hybrid_prefix_hit_over_two_ranks_resumes_what_one_process_resumes(hybrids, pool):
    """Prompts that go on from cached ones resume from stored states on every rank (the
    state copies ride in the step): tokens and logits equal one process's."""
    results = []
    for size in (1, 2):
        llm = probed(
            str(hybrids("qwen3.5")),
            worker_pool=pool if size == 2 else None,
            tensor_parallel_size=size,
            enforce_eager=False,
            **ARGS,
        )
        first = llm.generate(PROMPTS, PARAMS)
        again = llm.generate([[*prompt, 9, 9, 9] for prompt in PROMPTS], PARAMS)
        hits = llm.engine.stats().prefix_states.hits
        seen = records(llm)
        results.append((token_ids(first), token_ids(again), [logits_of(seen, o) for o in again]))
        assert hits > 0
    assert results[0][:2] == results[1][:2]
    for ours, reference in zip(results[1][2], results[0][2], strict=True):
        torch.testing.assert_close(ours, reference, atol=1e-4, rtol=0)
