"""A model's caches as groups (paged K/V per position, recurrent state per request) out
of one budget, and a recurrent state read that no declared input names is refused at
capture."""

from __future__ import annotations

import pytest
import torch

from tests.checkpoints import saved_model
from tests.helpers import greedy, token_ids
from tests.probes import probed, records
from updraft import LLM
from updraft.attention.cache_groups import (
    PAGED,
    RECURRENT,
    CacheSizes,
    allocate_caches,
    cache_groups,
    split_budget,
)
from updraft.graph.recorded import CaptureError
from updraft.model_config import ModelConfig
from updraft.models.gated_delta_net import GatedDeltaNet


@pytest.fixture(scope="module")
def qwen35_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3.5-caches")
    saved_model("qwen3.5", directory)
    return directory


def test_groups_of_a_hybrid_model_and_their_allocation(qwen35_dir):
    config = ModelConfig.from_dir(qwen35_dir)
    groups = cache_groups(config, torch.float32, torch.bfloat16, depth=4)
    paged, recurrent = groups
    assert paged.kind == PAGED and paged.layers == config.attention_layers
    assert recurrent.kind == RECURRENT and set(recurrent.layers) == config.linear_layers
    assert recurrent.layout.per_slot == (4, config.linear_attention.state_width)
    caches = allocate_caches(groups, config.num_layers, CacheSizes(6, 3), 4, "cpu")
    for layer, cache in enumerate(caches):
        if config.is_linear(layer):
            assert cache.shape == (3 + 1, 4, config.linear_attention.state_width)
            assert cache.dtype == torch.bfloat16
        else:
            assert cache.shape[1] == 6 * 4 + 1  # [2, slots + spare, heads, dim]


def test_state_slots_and_blocks_share_one_budget(qwen35_dir):
    config = ModelConfig.from_dir(qwen35_dir)
    groups = cache_groups(config, torch.float32)
    paged, recurrent = groups
    budget = 64 * 2**20
    sizes = split_budget(groups, budget, 16, max_num_seqs=8)
    assert sizes.num_state_slots == 8
    spent = sizes.num_state_slots * recurrent.bytes_per_slot
    spent += sizes.num_blocks * 16 * paged.bytes_per_slot
    assert budget - 16 * paged.bytes_per_slot < spent <= budget
    # Slots take at most half of a small budget; a budget without one is refused.
    small = 5 * recurrent.bytes_per_slot
    assert split_budget(groups, small, 16, max_num_seqs=8).num_state_slots == 2
    with pytest.raises(ValueError, match="holds no recurrent-state slot"):
        split_budget(groups, recurrent.bytes_per_slot, 16, max_num_seqs=8)


def test_the_state_dtype_is_a_setting(qwen35_dir):
    """bfloat16 state rows: the run completes, every linear layer's cache is bfloat16,
    and the greedy tokens mostly agree with float32 state's."""
    prompts = [list(range(3, 60)), list(range(100, 110))]
    plain = token_ids(LLM(str(qwen35_dir)).generate(prompts, [greedy(8)] * 2))
    llm = probed(str(qwen35_dir), mamba_cache_dtype="bfloat16", num_kv_blocks=64, max_num_seqs=4)
    got = token_ids(llm.generate(prompts, [greedy(8)] * 2))
    caches = records(llm).kv_caches("target")
    config = ModelConfig.from_dir(qwen35_dir)
    assert {caches[i].dtype for i in config.linear_layers} == {torch.bfloat16}
    assert {caches[i].dtype for i in config.attention_layers} == {torch.float32}
    assert got[0][:2] == plain[0][:2] and got[1][:2] == plain[1][:2]


def test_a_state_read_through_no_declared_input_is_refused_at_capture(qwen35_dir, monkeypatch):
    """A layer that addresses the state by slot indices it holds itself, not the step's
    state_slots, would replay them from the capture: capture names the read."""
    forward = GatedDeltaNet.forward
    held = torch.zeros(64, dtype=torch.long)

    def own_slots(self, hidden, state, state_slots, metadata):
        return forward(self, hidden, state, held[: state_slots.numel()], metadata)

    monkeypatch.setattr(GatedDeltaNet, "forward", own_slots)
    with pytest.raises(CaptureError, match=r"reads a \(\d+,\) torch.int64 tensor"):
        LLM(str(qwen35_dir), enforce_eager=False)


def test_a_model_with_no_full_attention_layer_serves_the_whole_context(tmp_path):
    """Every layer linear: no KV is kept, and blocks (which then cost nothing) still let
    each running request reach the context length."""
    reference = saved_model(
        "qwen3.5", tmp_path, layer_types=["linear_attention"] * 4, max_position_embeddings=256
    )
    llm = LLM(str(tmp_path), max_num_seqs=4)
    assert llm.engine.stats().kv_blocks_total >= 4 * 256 // 16
    prompt = list(range(5, 60))
    got = token_ids(llm.generate([prompt], [greedy(6)]))[0]
    tokens = list(prompt)  # transformers' cache needs an attention layer: whole forwards
    with torch.no_grad():
        for _ in range(6):
            logits = reference(torch.tensor([tokens]), use_cache=False).logits
            tokens.append(int(logits[0, -1].argmax()))
    assert got == tokens[len(prompt) :]
