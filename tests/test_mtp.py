"""DeepSeek's multi-token prediction layers in a tiny DeepSeek-V3 checkpoint carrying one
in DeepSeek's layout (``model.layers.{num_hidden_layers}.*``, ``tests/heads.py``): the
main model around them, preemption and prefix caching with them, and refusals. What
every draft head must do against transformers' ``MtpModel`` is in
``test_draft_heads.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from tests.checkpoints import mtp_checkpoint
from tests.helpers import greedy, token_ids
from updraft import LLM
from updraft.model_config import ModelConfig
from updraft.models.mtp import load_mtp_layers


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return mtp_checkpoint(tmp_path_factory.mktemp("deepseek-mtp"))


def test_the_engine_serves_the_main_model_of_a_checkpoint_with_mtp_layers(checkpoint):
    """The main model skips the MTP layer's tensors and equals transformers' greedy."""
    prompt = list(range(5, 17))
    got = LLM(checkpoint, block_size=4, num_kv_blocks=64).generate([prompt], greedy(12))[0]
    reference_model = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float32
    )
    expected = reference_model.generate(
        torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0
    )[0, len(prompt) :].tolist()
    assert got.outputs[0].token_ids == expected


def test_a_checkpoint_without_mtp_layers_says_so(tiny_deepseek):
    _, model_dir = tiny_deepseek
    config = ModelConfig.from_dir(model_dir)
    with pytest.raises(ValueError, match=r"num_nextn_predict_layers|missing"):
        load_mtp_layers(config, model_dir, torch.float32, "cpu")


def test_preemption_and_prefix_caching_keep_greedy_output_with_mtp(checkpoint):
    prompts = [list(range(10, 30)) + [i, i + 1] * (i % 3 + 1) for i in range(40, 52)]
    params = [greedy(n) for n in (30, 12, 22, 35) * 3]
    plain = LLM(checkpoint, block_size=4, num_kv_blocks=512).generate(prompts, params)
    llm = LLM(
        checkpoint,
        block_size=4,
        num_kv_blocks=40,
        max_num_batched_tokens=24,
        speculative_method="mtp",
    )
    got = llm.generate(prompts, params)
    assert token_ids(got) == token_ids(plain)
    assert sum(o.metrics.num_preemptions for o in got) > 0
    assert llm.engine.stats().kv_blocks_used == 0


def test_mtp_on_a_model_without_mtp_layers_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="no multi-token prediction layers"):
        LLM(tiny_llama, speculative_method="mtp")
