"""Shared fixtures: tiny random Hugging Face checkpoints saved with ``save_pretrained``."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

# The suite runs in two worker processes (pytest-xdist, pyproject's addopts), one per
# core: each keeps to one thread, or two workers' thread pools would take turns on
# the cores and spin waiting for each other. The servers, CLIs and ranks the tests
# start inherit it. Tests of multithreaded kernels ask for their threads themselves.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch
from hypothesis import settings

# CI replays the same examples every run, so a red CI always reproduces; locally each
# run explores new ones.
settings.register_profile("ci", derandomize=True)

# Engines here replay captured steps op by op: compiling them with inductor would cost
# seconds per engine. The tests of compiled runs ask for them explicitly, and
# UPDRAFT_COMPILE_GRAPHS=1 runs the whole suite compiled. Set before any engine starts,
# so the servers and CLIs the tests start inherit it.
os.environ.setdefault("UPDRAFT_COMPILE_GRAPHS", "0")
# One mixed-bucket size instead of five (EngineConfig.capture_tokens): every engine the
# suite starts would otherwise capture five more graphs, minutes over the whole suite.
# Steps of up to 32 tokens (most of the suite's prefills) still replay one.
os.environ.setdefault("UPDRAFT_CAPTURE_TOKENS", "32")
# The directories that stand for the tests' GGUF files go to a folder of the run's own,
# removed at the end, not into the user's cache.
os.environ["UPDRAFT_GGUF_CACHE"] = tempfile.mkdtemp(prefix="updraft-gguf-")
atexit.register(shutil.rmtree, os.environ["UPDRAFT_GGUF_CACHE"], ignore_errors=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=512,
    initializer_range=0.2,  # sharp logits: greedy choices are not near-ties
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
)

ARCHITECTURES = {
    # GQA with Llama 3 RoPE scaling and untied embeddings
    "llama": dict(
        num_key_value_heads=2,
        tie_word_embeddings=False,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    # MQA, tied embeddings, q/k/v bias
    "qwen2": dict(num_key_value_heads=1, tie_word_embeddings=True),
    # MHA, per-head q/k norm, explicit head_dim
    "qwen3": dict(num_key_value_heads=4, head_dim=32, tie_word_embeddings=False),
}


def make_tiny_checkpoint(kind: str, directory: Path, seed: int = 0, dtype=torch.float32) -> Path:
    import transformers

    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[kind]
    config = config_class(**TINY, **ARCHITECTURES[kind])
    torch.manual_seed(seed)
    model = model_class(config).to(dtype).eval()
    model.save_pretrained(directory)
    return directory


# DeepSeek: MLA with kv_lora_rank (24) unlike qk_rope_head_dim (8), so the cache's two
# parts cannot be swapped unnoticed; 8 routed experts in 2 groups, 1 shared, layer 0
# dense. V3.2's indexer keeps 6 tokens, fewer than most prompts, and has 16 heads: with
# few heads a key's weighted ReLU score is exactly 0 often enough for the top-k to tie.
DEEPSEEK_TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
    kv_lora_rank=24,
    qk_rope_head_dim=8,
    qk_nope_head_dim=12,
    v_head_dim=10,
    max_position_embeddings=512,
    initializer_range=0.2,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
)
DEEPSEEK = {
    "deepseek-v3": dict(q_lora_rank=16),
    "deepseek-v3-no-q-lora": dict(q_lora_rank=None),
    "deepseek-v3.2": dict(q_lora_rank=16, index_topk=6, index_head_dim=16, index_n_heads=16),
    # V2-Lite's attention (no q_lora); the softmax router, group-limited
    "deepseek-v2": dict(q_lora_rank=None, topk_method="group_limited_greedy"),
}


def make_deepseek_checkpoint(kind: str, directory: Path, seed: int = 0) -> Path:
    import transformers

    config_class, model_class = {
        "deepseek-v2": (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM),
        "deepseek-v3.2": (transformers.DeepseekV32Config, transformers.DeepseekV32ForCausalLM),
    }.get(kind, (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM))
    torch.manual_seed(seed)
    model = model_class(config_class(**DEEPSEEK_TINY, **DEEPSEEK[kind])).eval()
    with torch.no_grad():  # a bias that changes which experts win
        for name, tensor in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                tensor.normal_(0, 0.5)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session", params=sorted(DEEPSEEK))
def tiny_deepseek(request, tmp_path_factory) -> tuple[str, Path]:
    kind = request.param
    return kind, make_deepseek_checkpoint(kind, tmp_path_factory.mktemp(kind))


@pytest.fixture(scope="session", params=sorted(ARCHITECTURES))
def tiny_checkpoint(request, tmp_path_factory) -> tuple[str, Path]:
    kind = request.param
    return kind, make_tiny_checkpoint(kind, tmp_path_factory.mktemp(kind))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"))


def add_byte_tokenizer(model_dir: Path) -> Path:
    """A byte-level tokenizer with exactly 256 tokens (no merges), so the tiny models,
    whose vocabulary is 256, can take and return text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(model_dir / "tokenizer.json"))
    return model_dir


@pytest.fixture
def all_cores():
    """Every core's thread for one test, even in a one-thread worker: the C kernels
    split their rows over torch's thread count, and a kernel run on one thread would
    leave the split itself untested."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(2, os.cpu_count() or 1))
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_llama_with_tokenizer(tmp_path_factory) -> Path:
    model_dir = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama_text"))
    return add_byte_tokenizer(model_dir)


@pytest.fixture(scope="module")
def pool():
    """A module's worker processes: each engine's other ranks run on them, one engine
    after another, instead of on processes of its own."""
    from updraft import WorkerPool

    workers = WorkerPool()
    yield workers
    workers.close()
