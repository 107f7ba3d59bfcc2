"""Speculative verification: greedy rows reproduce greedy decoding token for token, and
sampled rows emit tokens distributed exactly as the filtered target distribution, whatever
the draft distribution was."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from updraft import SamplingParams
from updraft.runner.rejection_sampler import sample_draft, verify
from updraft.runner.sampler import sample
from updraft.step.sampling_batch import SamplingBatch


def batch_of(params: list[SamplingParams], seeds: list[int | None] | None = None) -> SamplingBatch:
    seeds = seeds or [None] * len(params)
    generators = [None if s is None else torch.Generator().manual_seed(s) for s in seeds]
    return SamplingBatch(params, generators)


# ---------------------------------------------------------------- greedy


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    batch_size=st.integers(1, 6),
    k=st.integers(0, 5),
    vocab=st.integers(2, 12),
)
def test_greedy_rows_emit_exactly_the_greedy_tokens(seed, batch_size, k, vocab):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch_size, k + 1, vocab, generator=gen)
    argmax = logits.argmax(-1)
    # Each row's drafts agree with the argmax for a random prefix, then are random.
    num_drafts = torch.randint(0, k + 1, (batch_size,), generator=gen).tolist()
    agree = torch.randint(0, k + 1, (batch_size,), generator=gen)
    random_drafts = torch.randint(0, vocab, (batch_size, k), generator=gen)
    drafts = torch.where(torch.arange(k) < agree[:, None], argmax[:, :k], random_drafts)
    # Greedy rows must behave the same next to sampled rows.
    temperatures = torch.randint(0, 2, (batch_size,), generator=gen).tolist()
    params = [SamplingParams(temperature=float(t)) for t in temperatures]

    result = verify(logits, drafts, num_drafts, None, batch_of(params), gen)

    for b in range(batch_size):
        if temperatures[b] != 0:
            continue
        accepted = 0
        while accepted < num_drafts[b] and drafts[b, accepted] == argmax[b, accepted]:
            accepted += 1
        # Greedy decoding without drafts would emit argmax at each position until the
        # first draft that differs from it, and that argmax too.
        assert result.num_accepted[b] == accepted
        assert result.token_ids[b] == argmax[b, : accepted + 1].tolist()


def test_no_drafts_means_one_greedy_token_from_position_zero():
    logits = torch.tensor([[[0.0, 3.0, 1.0], [9.0, 0.0, 0.0]]])
    result = verify(
        logits, torch.tensor([[1]]), [0], None, batch_of([SamplingParams(temperature=0.0)])
    )
    assert result.token_ids == [[1]]
    assert result.num_accepted == [0]
    assert result.logprobs is None


def test_padding_drafts_are_ignored_even_when_out_of_range():
    logits = torch.tensor([[[0.0, 3.0, 1.0], [0.0, 0.0, 5.0], [4.0, 0.0, 0.0]]])
    drafts = torch.tensor([[1, -1]])
    greedy = verify(logits, drafts, [1], None, batch_of([SamplingParams(temperature=0.0)]))
    assert greedy.token_ids == [[1, 2]]
    sampled = verify(logits, drafts, [1], None, batch_of([SamplingParams(temperature=1.0)], [0]))
    assert 1 <= len(sampled.token_ids[0]) == sampled.num_accepted[0] + 1 <= 2


# ---------------------------------------------------------------- distribution

# Chi-square critical values at significance 0.001, by degrees of freedom. With fixed
# seeds the test is deterministic; the level only says how unlucky a correct sampler
# would have to be to fail it.
CHI2_CRITICAL_0_001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}

BASE_PROBS = torch.tensor([0.35, 0.25, 0.15, 0.12, 0.08, 0.05])
VOCAB = len(BASE_PROBS)
TRIALS = 20_000


def expected_filtered(probs: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The target distribution from the definitions of the filters."""
    probs = probs ** (1 / params.temperature)
    probs = probs / probs.sum()
    order = probs.argsort(descending=True)
    keep = torch.zeros(len(probs), dtype=torch.bool)
    mass = 0.0
    for rank, token in enumerate(order.tolist()):
        if params.top_k > 0 and rank >= params.top_k:
            break
        if params.top_p < 1 and mass >= params.top_p:
            break
        keep[token] = True
        mass += probs[token].item()
    kept = probs * keep
    return kept / kept.sum()


def chi_square(tokens: torch.Tensor, expected: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic and its degrees of freedom; tokens of probability zero must
    not occur at all."""
    counts = torch.bincount(tokens, minlength=len(expected)).double()
    support = expected > 0
    assert counts[~support].sum() == 0, "a filtered-out token was emitted"
    expected_counts = expected[support].double() * len(tokens)
    statistic = ((counts[support] - expected_counts) ** 2 / expected_counts).sum().item()
    return statistic, int(support.sum()) - 1


def assert_follows(tokens: torch.Tensor, expected: torch.Tensor) -> None:
    statistic, dof = chi_square(tokens, expected)
    assert statistic < CHI2_CRITICAL_0_001[dof], (statistic, dof)


CASES = {
    "draft_k1": (1, "draft", SamplingParams(temperature=1.0)),
    "draft_k3_temperature": (3, "draft", SamplingParams(temperature=0.7)),
    "draft_k3_top_k": (3, "draft", SamplingParams(temperature=1.0, top_k=3)),
    "draft_k3_top_p": (3, "draft", SamplingParams(temperature=1.0, top_p=0.8)),
    "ngram_k1": (1, "ngram", SamplingParams(temperature=1.0)),
    "ngram_k3_temperature": (3, "ngram", SamplingParams(temperature=0.7)),
    "ngram_k3_top_k": (3, "ngram", SamplingParams(temperature=1.0, top_k=3)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_emitted_tokens_follow_the_filtered_target_distribution(case):
    k, proposer, params = CASES[case]
    gen = torch.Generator().manual_seed(sorted(CASES).index(case))
    # Each position has its own target distribution (a shuffle of BASE_PROBS), which does
    # not depend on the tokens before it, so emitted token i, given that drafts 0..i-1
    # were accepted, must follow p_i.
    target_probs = torch.stack(
        [BASE_PROBS[torch.randperm(VOCAB, generator=gen)] for _ in range(k + 1)]
    )
    expected = torch.stack([expected_filtered(p, params) for p in target_probs])
    logits = target_probs.log().expand(TRIALS, -1, -1)
    if proposer == "draft":
        # A draft distribution far from p, with mass on tokens the filters drop.
        draft_q = torch.rand(k, VOCAB, generator=gen) ** 2 + 0.02
        draft_q = draft_q / draft_q.sum(-1, keepdim=True)
        drafts = torch.multinomial(draft_q, TRIALS, replacement=True, generator=gen).T
        draft_probs = draft_q.expand(TRIALS, -1, -1)
    else:
        # A deterministic proposer: whatever it proposes, the output must follow p.
        drafts = (torch.arange(TRIALS)[:, None] + torch.arange(k)) % VOCAB
        draft_probs = None

    batch = batch_of([params] * TRIALS)
    result = verify(logits, drafts, [k] * TRIALS, draft_probs, batch, gen)

    num_accepted = torch.tensor(result.num_accepted)
    emitted = torch.tensor([tokens + [-1] * (k + 1 - len(tokens)) for tokens in result.token_ids])
    for i in range(k + 1):
        reached = num_accepted >= i
        assert_follows(emitted[reached, i], expected[i])

    # A sampled first draft is accepted with probability sum_x min(p(x), q(x)); a fixed
    # draft d with probability p(d).
    if proposer == "draft":
        acceptance = torch.minimum(expected[0], draft_q[0]).sum().item()
    else:
        acceptance = expected[0][drafts[:, 0]].mean().item()
    observed = (num_accepted >= 1).double().mean().item()
    assert observed == pytest.approx(acceptance, abs=4 * math.sqrt(0.25 / TRIALS))


def test_the_chi_square_check_can_tell_the_draft_distribution_from_the_target():
    # Guards the test above against passing vacuously: emitting the drafts unverified
    # must fail it.
    gen = torch.Generator().manual_seed(0)
    draft_q = torch.rand(VOCAB, generator=gen) ** 2 + 0.02
    draft_q = draft_q / draft_q.sum()
    drafts = torch.multinomial(draft_q, TRIALS, replacement=True, generator=gen)
    statistic, dof = chi_square(drafts, BASE_PROBS)
    assert statistic > 10 * CHI2_CRITICAL_0_001[dof]


# ---------------------------------------------------------------- seeds, logprobs, edges


def test_a_seeded_request_gives_the_same_tokens_alone_or_in_any_batch():
    torch.manual_seed(0)
    params = SamplingParams(temperature=0.9, top_k=20)
    logits = torch.randn(1, 3, 50) * 0.5  # flat enough that rejections happen
    drafts = torch.randint(0, 50, (1, 2))
    draft_probs = torch.softmax(torch.randn(1, 2, 50), -1)
    alone = verify(logits, drafts, [2], draft_probs, batch_of([params], [1234]))

    # In a wider batch (K = 4) among seeded and unseeded rows, at another row index.
    others = 3
    wide_logits = torch.randn(others + 1, 5, 50)
    wide_logits[2, :3] = logits[0]
    wide_drafts = torch.randint(0, 50, (others + 1, 4))
    wide_drafts[2, :2] = drafts[0]
    wide_probs = torch.softmax(torch.randn(others + 1, 4, 50), -1)
    wide_probs[2, :2] = draft_probs[0]
    mixed = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0),
        params,
        SamplingParams(),
    ]
    batch = batch_of(mixed, [7, None, 1234, None])
    together = verify(wide_logits, wide_drafts, [4, 3, 2, 1], wide_probs, batch)

    assert together.token_ids[2] == alone.token_ids[0]
    assert together.num_accepted[2] == alone.num_accepted[0]


def test_seeded_requests_vary_with_the_seed():
    logits = torch.zeros(1, 4, 1000)  # uniform: every draft survives with probability 1/2
    drafts = torch.zeros(1, 3, dtype=torch.long)
    outputs = {
        tuple(verify(logits, drafts, [3], None, batch_of([SamplingParams()], [s])).token_ids[0])
        for s in range(20)
    }
    assert len(outputs) > 10


def test_without_drafts_a_seeded_row_samples_what_the_plain_sampler_would():
    torch.manual_seed(1)
    logits = torch.randn(4, 100)
    params = [SamplingParams(temperature=0.8, top_p=0.9)] * 4
    seeds = [11, 12, 13, 14]
    plain, *_ = sample(logits, batch_of(params, seeds))
    result = verify(
        logits[:, None], torch.empty(4, 0, dtype=torch.long), [0] * 4, None, batch_of(params, seeds)
    )
    assert [tokens[0] for tokens in result.token_ids] == plain.tolist()


def test_logprobs_are_those_of_the_raw_target_logits_at_the_emitted_tokens():
    torch.manual_seed(2)
    batch_size, k, vocab = 5, 3, 30
    logits = torch.randn(batch_size, k + 1, vocab)
    drafts = torch.cat([logits[:2, :k].argmax(-1), torch.randint(0, vocab, (3, k))])
    params = [
        SamplingParams(temperature=0.0, logprobs=True),
        SamplingParams(temperature=0.6, top_k=5, logprobs=True),
        SamplingParams(temperature=1.0, logprobs=False),
        SamplingParams(temperature=1.2, min_p=0.05, logprobs=True),
        SamplingParams(temperature=0.0),
    ]
    result = verify(logits, drafts, [3, 3, 2, 1, 0], None, batch_of(params, [5] * 5))

    assert result.logprobs is not None
    reference = logits.log_softmax(-1)
    for b, tokens in enumerate(result.token_ids):
        expected = [reference[b, i, t].item() for i, t in enumerate(tokens)]
        assert result.logprobs[b] == pytest.approx(expected, abs=1e-5)


def test_no_logprobs_unless_asked():
    logits = torch.randn(2, 2, 8)
    drafts = torch.zeros(2, 1, dtype=torch.long)
    result = verify(logits, drafts, [1, 1], None, batch_of([SamplingParams()] * 2, [0, 1]))
    assert result.logprobs is None


def test_unreachable_or_unnormalised_draft_probabilities_stay_well_defined():
    # Token 0 holds all of p; the filters leave p zero on tokens 2 and 3.
    logits = torch.log(torch.tensor([0.7, 0.3, 0.0, 0.0])).expand(400, 3, 4).contiguous()
    params = [SamplingParams(temperature=1.0)] * 400
    gen = torch.Generator().manual_seed(3)
    # q(d) == 0 at draft 0 (p > 0): accept always. p(d) == 0 at draft 2: never accept.
    q = torch.tensor([[0.0, 0.1, 0.9, 0.0], [0.0, 0.1, 0.9, 0.0]]).expand(400, -1, -1)
    drafts = torch.tensor([0, 2]).expand(400, -1)
    result = verify(logits, drafts, [2] * 400, q, batch_of(params), gen)
    assert set(result.num_accepted) == {1}
    assert {tokens[1] for tokens in result.token_ids} <= {0, 1}

    # q >= p everywhere (not a distribution): rejections leave no residual mass, and the
    # correction falls back to p instead of dividing by zero.
    result = verify(logits, drafts, [2] * 400, 2 * logits.softmax(-1)[:, :2], batch_of(params), gen)
    assert 0 < sum(result.num_accepted) < 800
    assert all(t in (0, 1) for tokens in result.token_ids for t in tokens)


def test_invalid_shapes_are_refused():
    logits = torch.randn(2, 3, 5)
    batch = batch_of([SamplingParams()] * 2)
    with pytest.raises(ValueError, match="draft_token_ids"):
        verify(logits, torch.zeros(2, 3, dtype=torch.long), [2, 2], None, batch)
    with pytest.raises(ValueError, match="num_drafts"):
        verify(logits, torch.zeros(2, 2, dtype=torch.long), [3, 0], None, batch)
    with pytest.raises(ValueError, match="draft_probs"):
        verify(logits, torch.zeros(2, 2, dtype=torch.long), [2, 2], torch.rand(2, 2, 4), batch)


# ---------------------------------------------------------------- draft sampling


def test_draft_tokens_follow_the_q_they_report():
    params = SamplingParams(temperature=0.7, top_k=4)
    logits = BASE_PROBS.log().expand(TRIALS, -1)
    tokens, q = sample_draft(logits, batch_of([params] * TRIALS), torch.Generator().manual_seed(4))
    assert q is not None
    assert torch.allclose(q[0], expected_filtered(BASE_PROBS, params))
    assert_follows(tokens, q[0])


def test_greedy_draft_rows_take_the_argmax_with_one_hot_q():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 1.0]])
    tokens, q = sample_draft(
        logits, batch_of([SamplingParams(temperature=0.0), SamplingParams(temperature=0.0)])
    )
    assert tokens.tolist() == [1, 0]
    assert q is None

    tokens, q = sample_draft(
        logits, batch_of([SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)], [0, 0])
    )
    assert tokens[0] == 1
    assert q is not None
    assert q[0].tolist() == [0.0, 1.0, 0.0]
    assert torch.allclose(q[1], logits[1].softmax(-1))
