"""EAGLE-1 heads on the demo target with its shipped, trained head, and heads refused by
name. What every draft head must do against its reference (transformers'
``LlamaDecoderLayer`` and the head's own tensors, on tiny random Llama and Qwen3 targets
with random heads saved in the layout EAGLE heads are published in) is in
``test_draft_heads.py``."""

from __future__ import annotations

import json

import pytest

from benchmarks.bench_speculative import code_prompts
from tests.checkpoints import eagle_head_checkpoint
from tests.helpers import greedy
from updraft import LLM, SamplingParams
from updraft.demo import DEMO_DRAFT_DIR, DEMO_EAGLE_DIR, DEMO_MODEL_DIR
from updraft.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def heldout_prompts() -> list[list[int]]:
    return code_prompts(Tokenizer.from_dir(DEMO_MODEL_DIR), 8)


def test_the_demo_head_keeps_greedy_output_at_batch_1_and_16(heldout_prompts):
    prompts = (heldout_prompts * 2)[:16]
    params = [greedy(n) for n in (40, 7, 23, 31) * 4]
    expected = [o.outputs[0].token_ids for o in LLM().generate(prompts, params)]
    for enforce_eager in (True, False):
        llm = LLM(speculative_method="eagle", enforce_eager=enforce_eager)
        for batch in (1, 16):
            got = llm.generate(prompts[:batch], params[:batch])
            assert [o.outputs[0].token_ids for o in got] == expected[:batch]
        assert llm.engine.stats().kv_blocks_used == 0


def accepted_length(heldout_prompts, **speculation) -> float:
    llm = LLM(num_speculative_tokens=3, **speculation)
    llm.generate(heldout_prompts, [greedy(64)] * len(heldout_prompts))
    return llm.engine.stats().speculative.mean_accepted_length


def test_the_demo_head_drafts_better_than_the_demo_draft_model(heldout_prompts):
    """On held-out code at k = 3 the trained head's mean accepted length (tokens per
    verify step) beats the demo draft model's, measured here on the same prompts: a head
    that drafts noise accepts about 1."""
    eagle = accepted_length(heldout_prompts, speculative_method="eagle")
    draft = accepted_length(heldout_prompts, speculative_model=str(DEMO_DRAFT_DIR))
    assert eagle > draft > 1.5, (eagle, draft)


def test_sampled_requests_with_eagle_finish_and_repeat_with_a_seed(heldout_prompts):
    params = [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24, seed=i) for i in range(4)]
    runs = []
    for _ in range(2):
        llm = LLM(speculative_method="eagle")
        runs.append([o.outputs[0].token_ids for o in llm.generate(heldout_prompts[:4], params)])
        assert sum(llm.engine.stats().speculative.accepted) > 0
        assert llm.engine.stats().kv_blocks_used == 0
    assert runs[0] == runs[1] and all(len(ids) == 24 for ids in runs[0])


def test_bad_heads_are_refused_by_name(tmp_path, tiny_llama):
    head_dir = eagle_head_checkpoint(tmp_path / "head", tiny_llama)
    with pytest.raises(ValueError, match="needs speculative_model"):
        LLM(tiny_llama, speculative_method="eagle")
    with pytest.raises(ValueError, match="hidden_size"):
        LLM(DEMO_MODEL_DIR, speculative_method="eagle", speculative_model=str(head_dir))
    eagle3 = tmp_path / "eagle3"
    eagle3.mkdir()
    raw = json.loads((DEMO_EAGLE_DIR / "config.json").read_text())
    raw.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=1024)
    (eagle3 / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="EAGLE-3"):
        LLM(speculative_method="eagle", speculative_model=str(eagle3))
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        LLM(speculative_method="eagle", speculative_model=str(tmp_path))
