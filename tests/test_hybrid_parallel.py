"""Tensor parallelism over the hybrid Qwen3.5 family: two ranks, each with its share of
the Gated DeltaNet heads (and of their state) and of the gated attention's heads,
compute what one process computes, token for token and logit for logit.

Tiny random checkpoints (tests/test_qwen35.py): 2 linear-attention key heads, each
serving 2 value heads, so each rank keeps one key head and its two value heads; 4
gated attention heads over 2 KV heads. The prompts of tests/test_tensor_parallel.py run
as a mixed batch with chunked prefill over block boundaries.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import token_ids
from tests.probes import records
from tests.test_qwen35 import build
from tests.test_tensor_parallel import run
from updraft import LLM
from updraft.model_config import ModelConfig

EAGER = dict(enforce_eager=True)
GRAPHS = dict(enforce_eager=False, capture_sizes=(4,))
NGRAM = dict(speculative_method="ngram", num_speculative_tokens=3)


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory) -> dict:
    """kind -> its tiny checkpoint's directory, built when first asked for."""
    root = tmp_path_factory.mktemp("hybrid-tp")
    made = {}

    def checkpoint(kind: str):
        if kind not in made:
            build(kind, root / kind)
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
def test_two_ranks_compute_what_one_process_computes(hybrids, pool, kind, args):
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
