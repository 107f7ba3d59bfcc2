"""Sampling: parameter validation, the filters, the distribution drawn, seeds, logprobs."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import greedy
from tests.probes import logits_of, probed, records
from updraft import LLM, SamplingParams
from updraft.runner.sampler import filtered_probs, sample
from updraft.step.sampling_batch import SamplingBatch


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("max_tokens", 2.5),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_k", -2),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("min_p", -0.1),
        ("min_p", 2),
        ("seed", "7"),
        ("seed", -(2**63) - 1),
        ("seed", 2**64),
        ("top_k", 2**63),
        ("stop", [""]),
        ("stop_token_ids", [-1]),
        ("ignore_eos", "yes"),
        ("logprobs", 21),
        ("logprobs", "5"),
    ],
)
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} must be"):
        SamplingParams(**{field: value})


def batch_of(*params: SamplingParams) -> SamplingBatch:
    return SamplingBatch(list(params), [None] * len(params))


def test_filters_keep_exactly_the_expected_tokens():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.05, 0.05]]))
    cases = [
        (SamplingParams(top_k=2), [0, 1]),
        (SamplingParams(top_p=0.65), [0, 1]),  # 0.4 < 0.65 <= 0.7
        (SamplingParams(top_p=0.4), [0]),
        (SamplingParams(min_p=0.45), [0, 1, 2]),  # keeps p >= 0.45 * 0.4
        (SamplingParams(top_k=3, top_p=0.5), [0, 1]),  # top-p renormalises after top-k
    ]
    for params, kept in cases:
        probs = filtered_probs(logits, batch_of(params))[0]
        assert torch.nonzero(probs).flatten().tolist() == kept, params
        assert probs.sum().item() == pytest.approx(1.0)


def test_top_k_rows_differ_within_one_batch():
    """Top-k alone takes a path without a sort; rows with other k, or none, must each
    keep exactly their own largest tokens."""
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    rows = [SamplingParams(top_k=k) for k in (1, 7, 0, 50)]
    probs = filtered_probs(logits, SamplingBatch(rows, [None] * 4))
    for row, k in enumerate((1, 7, 50, 50)):
        kept = set(torch.nonzero(probs[row]).flatten().tolist())
        assert kept == set(logits[row].topk(k).indices.tolist())


@pytest.mark.parametrize("scale", [8.0, 0.01])  # peaked rows, and flat ones past 1024
def test_top_p_over_candidates_equals_a_full_sort(scale):
    from updraft.runner.sampler import TOP_P_CANDIDATES

    torch.manual_seed(0)
    vocab = 4 * TOP_P_CANDIDATES
    logits = torch.randn(6, vocab) * scale
    rows = [
        SamplingParams(top_p=0.9),
        SamplingParams(top_p=0.5, top_k=20),
        SamplingParams(top_k=5),
        SamplingParams(),
        SamplingParams(top_p=0.99),
        SamplingParams(top_p=0.3, min_p=0.1),
    ]
    batch = SamplingBatch(rows, [None] * len(rows))
    probs = filtered_probs(logits, batch)
    # The reference: each row alone, through a plain sort of the whole vocabulary.
    for row, params in enumerate(rows):
        ordered, order = logits[row].sort(descending=True)
        keep = torch.ones(vocab, dtype=torch.bool)
        if params.top_k > 0:
            keep &= torch.arange(vocab) < params.top_k
        p = ordered.masked_fill(~keep, float("-inf")).softmax(-1)
        if params.top_p < 1:  # top-p 1 keeps everything, whatever the rounding of the sum
            keep &= (p.cumsum(-1) - p) < params.top_p
        p = ordered.masked_fill(~keep, float("-inf")).softmax(-1)
        if params.min_p > 0:
            keep &= p >= params.min_p * p.max()
        assert set(order[keep].tolist()) == set(torch.nonzero(probs[row]).flatten().tolist())


def test_temperature_scales_logits():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    probs = filtered_probs(logits, batch_of(SamplingParams(temperature=0.5)))[0]
    assert torch.allclose(probs, (logits[0] / 0.5).softmax(-1))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=4),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=1.0, min_p=0.1),
    ],
)
def test_samples_follow_the_filtered_distribution(params):
    torch.manual_seed(0)
    logits = torch.randn(1, 8) * 1.5
    trials = 40_000
    batch = batch_of(*[params] * trials)
    expected = filtered_probs(logits, batch_of(params))[0]
    tokens, *_ = sample(logits.expand(trials, -1), batch, torch.Generator().manual_seed(1))
    empirical = torch.bincount(tokens, minlength=8).float() / trials
    total_variation = 0.5 * (empirical - expected).abs().sum().item()
    assert total_variation < 0.015
    assert empirical[expected == 0].sum() == 0


def test_greedy_rows_take_the_argmax():
    logits = torch.randn(3, 10)
    batch = batch_of(SamplingParams(temperature=0), SamplingParams(), SamplingParams(temperature=0))
    tokens, *_ = sample(logits, batch)
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


def test_seeded_request_gives_the_same_text_whatever_the_batch(tiny_llama):
    llm = LLM(tiny_llama, num_kv_blocks=128)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=20, ignore_eos=True)
    alone = llm.generate([[1, 2, 3]], seeded)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=25, ignore_eos=True)
    batch = llm.generate([[9, 9], [1, 2, 3], [4, 5, 6, 7]], [others, seeded, others])
    assert batch[1].outputs[0].token_ids == alone
    different_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=20)
    assert llm.generate([[1, 2, 3]], different_seed)[0].outputs[0].token_ids != alone


def test_logprobs_are_those_of_the_sampled_tokens(tiny_llama):
    llm = probed(tiny_llama, num_kv_blocks=64)
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=6, logprobs=True, ignore_eos=True)
    output = llm.generate([[5, 6, 7]], params)[0]
    plain = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))[0].outputs[0]
    assert plain.logprobs is None
    completion = output.outputs[0]
    assert len(completion.logprobs) == 6
    for token, logprob, logits in zip(
        completion.token_ids, completion.logprobs, logits_of(records(llm), output), strict=True
    ):
        assert logprob == pytest.approx(logits.log_softmax(-1)[token].item(), abs=1e-5)


def test_a_seeded_request_gives_the_same_text_however_its_prompt_is_chunked(tiny_llama):
    """A prefill chunk short of the prompt's end samples nothing, so it draws nothing
    from the request's generator either."""
    seeded = SamplingParams(temperature=1.0, seed=77, max_tokens=12, ignore_eos=True)
    prompt = list(range(1, 40))
    texts = [
        LLM(tiny_llama, num_kv_blocks=64, max_num_batched_tokens=budget)
        .generate([prompt], seeded)[0]
        .outputs[0]
        .token_ids
        for budget in (1024, 7)
    ]
    assert texts[0] == texts[1]


@pytest.mark.parametrize(
    "extreme",
    [
        {"temperature": 1e-40},
        {"temperature": 5e-324},
        {"top_p": 1e-300},
        {"temperature": 1e-40, "top_p": 1e-300},
        {"min_p": 1.0},
        {"top_k": 1},
        {"top_k": 2**31 - 1, "temperature": 1e-30},
    ],
)
def test_extreme_sampling_values_behave_as_their_limit(tiny_llama, extreme):
    """Each of these is greedy in the limit, and must give greedy's tokens rather than
    a silent wrong answer (token 0 from NaN probabilities, say)."""
    llm = LLM(tiny_llama, num_kv_blocks=64)
    greedy_ids = llm.generate([[5, 6, 7]], greedy(10, ignore_eos=False))
    params = SamplingParams(max_tokens=10, seed=0, **extreme)
    assert llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids == (
        greedy_ids[0].outputs[0].token_ids
    )


def test_a_huge_temperature_samples_every_token_alike(tiny_llama):
    llm = LLM(tiny_llama, num_kv_blocks=64)
    params = SamplingParams(temperature=1e30, max_tokens=200, seed=0, ignore_eos=True)
    tokens = llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids
    assert len(set(tokens)) > 100  # near-uniform over 256 tokens, no NaN collapse to one id
