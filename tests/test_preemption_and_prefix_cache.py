"""Under a KV budget small enough to force preemption, with prefix caching on, greedy
outputs are identical to an unconstrained run, and no block is left behind."""

from __future__ import annotations

from tests.helpers import greedy
from tests.probes import assert_idle, probed, records
from updraft import LLM

# Shared heads exercise the prefix cache; lengths cross block boundaries.
HEAD = list(range(10, 42))
PROMPTS = [HEAD + [i, i + 1, i + 2] * (i % 4 + 1) for i in range(50, 62)] + [[7, 8, 9]]


def run(model_dir, **engine_args):
    llm = LLM(model_dir, block_size=4, **engine_args)
    params = greedy(40)
    outputs = llm.generate(PROMPTS, params)
    return llm, outputs


def test_preemption_and_prefix_caching_keep_greedy_outputs(tiny_llama):
    _, expected = run(tiny_llama, num_kv_blocks=512, enable_prefix_caching=False)
    llm, got = run(
        tiny_llama, num_kv_blocks=40, max_num_batched_tokens=24, enable_prefix_caching=True
    )
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert sum(o.metrics.num_preemptions for o in got) > 0, "the budget did not force preemption"
    assert_idle(llm)


def test_prefix_cache_hits_skip_prefill_work(tiny_llama):
    llm = probed(tiny_llama, block_size=4, num_kv_blocks=256)
    first = llm.generate(PROMPTS[0], greedy(4))[0]
    again = llm.generate(PROMPTS[0], greedy(4))[0]
    computed = [
        s.num_tokens for s in records(llm).steps_of("target") if s.request_ids == [again.request_id]
    ]
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    # The prompt's full blocks come from the cache (all but the last token's block, whose
    # logits are needed): only the tail is prefilled.
    cached_tokens = (len(PROMPTS[0]) - 1) // 4 * 4
    assert computed[0] == len(PROMPTS[0]) - cached_tokens
