"""vLLM's sampling fields: penalties, logit_bias, min_tokens, bad_words,
allowed_token_ids, top logprobs and n, against transformers' logits processors and the
OpenAI penalty formula, exact under every proposer and with graphs on and off."""

from __future__ import annotations

import pytest
import torch
import transformers

from tests.helpers import greedy
from tests.test_rejection_sampler import assert_follows
from updraft import LLM, SamplingParams
from updraft.demo import DEMO_DRAFT_DIR, DEMO_MODEL_DIR
from updraft.engine.kv_blocks import BlockPool
from updraft.request import Request
from updraft.runner.logits_processors import adjust_logits
from updraft.runner.rejection_sampler import verify
from updraft.speculative.registry import PROPOSERS, register_proposer
from updraft.step.logits_adjustments import logits_adjustments
from updraft.step.plan import Draft
from updraft.step.sampling_batch import SamplingBatch

PROMPT = "The quick brown fox"
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def demo():
    return LLM(capture_sizes=(1, 2, 4, 8))


@pytest.fixture(scope="module")
def hf_model():
    return transformers.AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32)


class OpenAIPenalties(transformers.LogitsProcessor):
    """OpenAI's documented formula: mu[j] - c[j] * frequency - (c[j] > 0) * presence, c
    counting the generated tokens."""

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids, scores):
        counts = torch.zeros_like(scores)
        generated = input_ids[:, self.prompt_len :]
        counts.scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - counts * self.frequency - (counts > 0).to(scores.dtype) * self.presence


def reference(hf_model, prompt_ids: list[int], field: str, value, extra=None) -> list[int]:
    """transformers' greedy generate with the processor that field means."""
    ids = torch.tensor([prompt_ids])
    kwargs: dict = {"eos_token_id": None}
    processors = transformers.LogitsProcessorList()
    if field == "repetition_penalty":
        processors.append(transformers.RepetitionPenaltyLogitsProcessor(value))
    elif field == "penalties":
        processors.append(OpenAIPenalties(len(prompt_ids), *value))
    elif field == "logit_bias":
        processors.append(
            transformers.SequenceBiasLogitsProcessor({(t,): b for t, b in value.items()})
        )
    elif field == "min_tokens":
        processors.append(
            transformers.MinNewTokensLengthLogitsProcessor(len(prompt_ids), value, extra)
        )
        kwargs["eos_token_id"] = extra
    elif field == "bad_words":
        processors.append(transformers.NoBadWordsLogitsProcessor(value, eos_token_id=None))
    elif field == "allowed_token_ids":
        kwargs["prefix_allowed_tokens_fn"] = lambda batch, tokens: value
    out = hf_model.generate(
        ids,
        max_new_tokens=MAX_TOKENS,
        do_sample=False,
        logits_processor=processors,
        pad_token_id=0,
        **kwargs,
    )
    return out[0, len(prompt_ids) :].tolist()


def field_cases(plain: list[int]) -> list[tuple[str, dict, str, object, object]]:
    """(name, SamplingParams fields, transformers field, value, extra), chosen from the
    plain greedy output so that each field changes it."""
    stop = plain[3]
    return [
        ("repetition", {"repetition_penalty": 1.8}, "repetition_penalty", 1.8, None),
        ("repetition-below-1", {"repetition_penalty": 0.7}, "repetition_penalty", 0.7, None),
        (
            "frequency-presence",
            {"frequency_penalty": 1.5, "presence_penalty": 0.8},
            "penalties",
            (1.5, 0.8),
            None,
        ),
        ("logit-bias", {"logit_bias": {plain[1]: -30.0, 7: 4.0}}, "logit_bias", None, None),
        ("min-tokens", {"min_tokens": 8, "stop_token_ids": [stop]}, "min_tokens", 8, [stop]),
        ("bad-words", {}, "bad_words", [[plain[2]], [plain[5], plain[6]]], None),
        ("allowed", {"allowed_token_ids": sorted(set(plain[:6]))}, "allowed_token_ids", None, None),
    ]


def our_params(fields: dict) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, **fields)


def test_each_field_gives_transformers_greedy_tokens(demo, hf_model):
    prompt_ids = demo.tokenizer.encode(PROMPT)
    plain = demo.generate(prompt_ids, greedy(MAX_TOKENS))[0].outputs[0].token_ids
    assert plain == reference(hf_model, prompt_ids, "none", None)
    for name, fields, field, value, extra in field_cases(plain):
        if field == "logit_bias":
            value = fields["logit_bias"]
        if field == "allowed_token_ids":
            value = fields["allowed_token_ids"]
        expected = reference(hf_model, prompt_ids, field, value, extra)
        if field == "bad_words":
            got = generate_with_bad_word_ids(demo, prompt_ids, value)
        else:
            output = demo.generate(prompt_ids, our_params(fields))[0]
            got = output.outputs[0].token_ids
            if field == "min_tokens":
                assert len(got) > 8 and extra[0] not in got[:8], name
        assert got == expected, name
        assert got != plain, f"{name} changed nothing: the case tests nothing"
    # Past min_tokens a stop token stops as ever.
    stop = plain[3]
    early = demo.generate(prompt_ids, greedy(MAX_TOKENS, min_tokens=2, stop_token_ids=[stop]))
    assert early[0].outputs[0].token_ids == plain[:4]
    assert early[0].outputs[0].finish_reason == "stop"


def generate_with_bad_word_ids(llm: LLM, prompt_ids: list[int], words: list[list[int]]):
    """bad_words are strings in the API; spelled as these token ids, through a request
    whose words the engine tokenizes to exactly them."""
    texts = [llm.tokenizer.decode(word) for word in words]
    for text, word in zip(texts, words, strict=True):
        assert llm.tokenizer.encode(text) == word, "the case needs words that round-trip"
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, bad_words=texts)
    return llm.generate(prompt_ids, params)[0].outputs[0].token_ids


# -- the logits themselves, against the processors ------------------------------------------


def fake_request(prompt: list[int], output: list[int], params: SamplingParams, **fields):
    request = Request("r", None, prompt, params, **fields)
    request.token_ids.extend(output)
    return request


def test_adjusted_logits_equal_the_processors_at_every_draft_position():
    """Rows after draft j see the drafts before them as output: each row equals
    transformers' processors applied to prompt + output + drafts[:j]."""
    gen = torch.Generator().manual_seed(0)
    vocab, prompt, output, drafts = 50, [3, 4, 5, 3], [7, 7, 9, 4], [9, 11, 7]
    params = SamplingParams(
        temperature=0,
        repetition_penalty=1.3,
        frequency_penalty=0.4,
        presence_penalty=0.3,
        logit_bias={2: 5.0, 11: -3.0},
        min_tokens=6,
        stop_token_ids=[12],
        max_tokens=20,
    )
    request = fake_request(
        prompt, output, params, eos_token_ids=(1,), bad_words_token_ids=((4, 9, 13), (20,))
    )
    logits = torch.randn(len(drafts) + 1, vocab, generator=gen) * 3
    adjusted = adjust_logits(logits, logits_adjustments([request], [drafts]))
    for j in range(len(drafts) + 1):
        seen = torch.tensor([prompt + output + drafts[:j]])
        row = logits[j : j + 1].clone()
        # vLLM's order: bad words, min_tokens, logit_bias, then the penalties.
        row = transformers.NoBadWordsLogitsProcessor([[4, 9, 13], [20]], eos_token_id=None)(
            seen, row
        )
        row = transformers.MinNewTokensLengthLogitsProcessor(len(prompt), 6, [1, 12])(seen, row)
        row = transformers.SequenceBiasLogitsProcessor({(2,): 5.0, (11,): -3.0})(seen, row)
        row = transformers.RepetitionPenaltyLogitsProcessor(1.3)(seen, row)
        row = OpenAIPenalties(len(prompt), 0.4, 0.3)(seen, row)
        torch.testing.assert_close(adjusted[j : j + 1], row, atol=1e-5, rtol=0)
    # The output ends with 4 and draft 0 is 9: only the row after it may not say 13.
    assert torch.isinf(adjusted[:, 13]).tolist() == [False, True, False, False]


def test_allowed_tokens_keep_only_theirs():
    params = SamplingParams(allowed_token_ids=[3, 8], logit_bias={8: 1.0})
    request = fake_request([1, 2], [], params)
    logits = torch.randn(2, 10)
    adjusted = adjust_logits(logits, logits_adjustments([request], [[3]]))
    assert torch.isinf(adjusted[:, [0, 1, 2, 4, 5, 6, 7, 9]]).all()
    torch.testing.assert_close(adjusted[:, 3], logits[:, 3])
    torch.testing.assert_close(adjusted[:, 8], logits[:, 8] + 1)


def test_a_penalised_distribution_is_what_speculation_samples():
    """Chi-square: with a draft drawn from q and the target penalised, the first emitted
    token follows the penalised p at position 0, and the second (where the first draft
    was accepted) the penalised p at position 1, which counts that draft."""
    trials = 40000
    gen = torch.Generator().manual_seed(3)
    params = SamplingParams(temperature=1.0, repetition_penalty=2.0, presence_penalty=1.0)
    request = fake_request([0, 1], [2], params)
    logits = torch.tensor([[1.0, 0.5, 2.0, 0.0, 1.5, -0.5], [0.5, 1.0, 1.0, 1.2, 0.3, 0.0]])
    q = torch.softmax(torch.tensor([0.0, 0.0, 0.0, 2.0, 0.0, 0.0]), -1)
    draft_tokens = torch.multinomial(q, trials, replacement=True, generator=gen)
    firsts, seconds = [], []
    for draft in set(draft_tokens.tolist()):
        rows = (draft_tokens == draft).nonzero()[:, 0]
        adjusted = adjust_logits(logits, logits_adjustments([request], [[draft]]))
        count = len(rows)
        result = verify(
            adjusted[None].expand(count, -1, -1),
            torch.full((count, 1), draft),
            [1] * count,
            q[None, None].expand(count, 1, -1).clone(),
            SamplingBatch([params] * count, [None] * count),
            torch.Generator().manual_seed(draft),
        )
        firsts += [tokens[0] for tokens in result.token_ids]
        seconds += [tokens[1] for tokens in result.token_ids if len(tokens) == 2 and draft == 3]
    adjusted = adjust_logits(logits, logits_adjustments([request], [[3]]))
    p0, p1 = adjusted.softmax(-1)
    assert_follows(torch.tensor(firsts), p0)
    assert len(seconds) > 2000
    assert_follows(torch.tensor(seconds), p1)
    assert not torch.allclose(p1, logits[1].softmax(-1), atol=0.05), "the penalty did nothing"


# -- speculation and graphs -------------------------------------------------------------


SPECULATIVE = {
    "eager": {"enforce_eager": True},
    "ngram": {"speculative_method": "ngram", "num_speculative_tokens": 3},
    "draft-model": {"speculative_model": str(DEMO_DRAFT_DIR), "num_speculative_tokens": 3},
    "eagle": {"speculative_method": "eagle", "num_speculative_tokens": 3},
}


@pytest.mark.parametrize("engine", sorted(SPECULATIVE))
def test_greedy_with_every_field_is_the_same_under_speculation_and_graphs(demo, engine):
    prompt_ids = demo.tokenizer.encode(PROMPT)
    plain = demo.generate(prompt_ids, greedy(MAX_TOKENS))[0].outputs[0].token_ids
    cases = [our_params(fields) for _, fields, *_ in field_cases(plain)]
    cases.append(SamplingParams(temperature=0, max_tokens=MAX_TOKENS, bad_words=["the", "fox"]))
    cases.append(
        SamplingParams(
            temperature=0,
            max_tokens=MAX_TOKENS,
            repetition_penalty=1.4,
            frequency_penalty=0.5,
            logit_bias={plain[0]: -50},
            min_tokens=4,
            logprobs=5,
        )
    )
    prompts = [prompt_ids] * len(cases)
    expected = demo.generate(prompts, cases)
    llm = LLM(capture_sizes=(1, 2, 4, 8, 16), **SPECULATIVE[engine])
    got = llm.generate(prompts, cases)
    for want, have in zip(expected, got, strict=True):
        assert have.outputs[0].token_ids == want.outputs[0].token_ids
    assert got[-1].outputs[0].top_logprobs is not None
    stats = llm.engine.stats()
    if engine != "eager":
        assert stats.speculative.rounds > 0
        assert "graph" in stats.steps


class Oracle:
    """Drafts the tokens each request will emit (known from a run without speculation):
    every draft is right, so a verify row that saw the wrong history emits a wrong
    token instead of accepting."""

    wants_hidden_states = False
    runner = None

    def __init__(self, futures: dict[tuple[int, ...], list[int]]) -> None:
        self.futures = futures

    def propose(self, inputs, output, drafting):
        drafts = {}
        for request, limit in drafting:
            done = request.num_output_tokens
            ahead = self.futures[tuple(request.prompt_token_ids)][done : done + limit]
            if ahead:
                drafts[request.request_id] = Draft(ahead)
        return drafts


def test_drafts_of_the_right_tokens_are_all_accepted_under_every_field(demo):
    prompt_ids = demo.tokenizer.encode(PROMPT)
    plain = demo.generate(prompt_ids, greedy(MAX_TOKENS))[0].outputs[0].token_ids
    cases = [our_params(fields) for _, fields, *_ in field_cases(plain)]
    prompts = [[*prompt_ids, 5 + i] for i in range(len(cases))]
    expected = [o.outputs[0].token_ids for o in demo.generate(prompts, cases)]
    futures = {tuple(p): e for p, e in zip(prompts, expected, strict=True)}
    register_proposer("oracle", lambda context: Oracle(futures))
    try:
        llm = LLM(capture_sizes=(1, 2, 4, 8), speculative_method="oracle", num_speculative_tokens=4)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, cases)]
    finally:
        del PROPOSERS["oracle"]
    assert got == expected
    assert llm.engine.stats().speculative.acceptance_rate == 1.0


# -- logprobs -------------------------------------------------------------------------------


def test_top_logprobs_are_transformers_log_softmax(demo, hf_model):
    params = SamplingParams(temperature=0.8, seed=4, max_tokens=10, logprobs=20)
    output = demo.generate(PROMPT, params)[0]
    completion = output.outputs[0]
    tokens = torch.tensor([output.prompt_token_ids + completion.token_ids])
    with torch.no_grad():
        logprobs = hf_model(tokens).logits[0].log_softmax(-1)
    start = len(output.prompt_token_ids) - 1
    assert len(completion.top_logprobs) == len(completion.token_ids)
    for i, top in enumerate(completion.top_logprobs):
        values, ids = logprobs[start + i].topk(20)
        assert list(top) == ids.tolist()
        assert list(top.values()) == pytest.approx(values.tolist(), abs=1e-4)
    assert len(demo.generate(PROMPT, SamplingParams(logprobs=0))[0].outputs[0].logprobs) == 16


def test_prompt_logprobs_are_transformers_log_softmax_chunked_and_preempted(hf_model):
    """Prompts computed in chunks of 16 tokens, two of them sharing the cache with a
    plain request, and a draft model mirroring every step."""
    llm = LLM(
        capture_sizes=(1, 2),
        max_num_batched_tokens=16,
        speculative_model=str(DEMO_DRAFT_DIR),
        num_speculative_tokens=2,
    )
    prompts = [llm.tokenizer.encode(PROMPT * 6), llm.tokenizer.encode("Once upon a time " * 5)]
    outputs = llm.generate(
        [prompts[0], prompts[1], prompts[0]],
        [
            SamplingParams(max_tokens=4, prompt_logprobs=3),
            SamplingParams(max_tokens=4, prompt_logprobs=0, n=2),
            SamplingParams(max_tokens=4),
        ],
    )
    assert outputs[2].prompt_logprobs is None
    for output, ids, k in zip(outputs, prompts, (3, 0), strict=False):
        check_prompt_logprobs(hf_model, output.prompt_logprobs, ids, k)
    assert llm.engine.stats().kv_blocks_used == 0
    # Preempted mid-prompt, a request computes its prompt again: each position once.
    small = LLM(block_size=4, num_kv_blocks=40, max_num_batched_tokens=24, enforce_eager=True)
    many = [[*prompts[1][:30], i] for i in range(8)]
    outputs = small.generate(many, greedy(40, prompt_logprobs=1))
    assert sum(o.metrics.num_preemptions for o in outputs) > 0, "nothing was preempted"
    for output, ids in zip(outputs, many, strict=True):
        check_prompt_logprobs(hf_model, output.prompt_logprobs, ids, 1)


def check_prompt_logprobs(hf_model, scored, ids: list[int], k: int) -> None:
    with torch.no_grad():
        expected = hf_model(torch.tensor([ids])).logits[0].log_softmax(-1)
    assert len(scored) == len(ids) and scored[0] is None
    for position in range(1, len(ids)):
        entry = scored[position]
        assert next(iter(entry)) == ids[position]
        want = float(expected[position - 1, ids[position]])
        assert entry[ids[position]] == pytest.approx(want, abs=1e-4)
        values, tokens = expected[position - 1].topk(k)
        for token, value in zip(tokens.tolist(), values.tolist(), strict=True):
            assert entry[token] == pytest.approx(value, abs=1e-4)
        assert len(entry) <= k + 1


# -- n ------------------------------------------------------------------------------------------


def test_n_sequences_share_the_prompt_s_blocks(monkeypatch):
    allocated = []
    original = BlockPool.allocate

    def counting(self, count):
        blocks = original(self, count)
        allocated.extend(blocks)
        return blocks

    monkeypatch.setattr(BlockPool, "allocate", counting)
    llm = LLM(capture_sizes=(1, 2, 4))
    block = llm.engine.config.positions_per_block
    prompt = list(range(10, 10 + 5 * block + 3))  # five full blocks and a partial one
    sampled = llm.generate(prompt, SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=6))
    completions = sampled[0].outputs
    assert [c.index for c in completions] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in completions}) > 1, "sampled sequences all equal"
    # The first sequence allocates the prompt's 6 blocks; each other one only its last.
    assert len(allocated) == 6 + 3, allocated
    assert sampled[0].metrics.num_output_tokens == 4 * 6
    greedy_n = llm.generate(prompt, SamplingParams(n=3, temperature=0, max_tokens=6))[0]
    assert len({tuple(c.token_ids) for c in greedy_n.outputs}) == 1
    assert llm.engine.stats().kv_blocks_used == 0


def test_n_streams_each_index_and_aborts_as_one(demo):
    stream = demo.generate_stream(PROMPT, SamplingParams(n=3, max_tokens=30, seed=1))
    seen = set()
    for output in stream:
        seen.add(output.outputs[0].index)
        if len(seen) == 3:
            assert demo.abort(output.request_id)
            break
    stream.close()
    drained = demo.engine.step()  # the aborted sequences' last outputs
    assert {o.outputs[0].finish_reason for o in drained} == {"abort"}
    assert [o.finished for o in drained] == [False] * (len(drained) - 1) + [True]
    assert demo.engine.stats().kv_blocks_used == 0
    assert not demo.engine.has_unfinished


# -- the rest ---------------------------------------------------------------------------------


def test_stop_strings_kept_and_special_tokens_spelled(demo):
    plain = demo.generate(PROMPT, greedy(MAX_TOKENS))[0].outputs[0].text
    stop = plain[5:8]
    cut = demo.generate(PROMPT, greedy(MAX_TOKENS, stop=[stop]))[0].outputs[0]
    kept = demo.generate(PROMPT, greedy(MAX_TOKENS, stop=[stop], include_stop_str_in_output=True))[
        0
    ].outputs[0]
    assert kept.text == cut.text + stop and kept.finish_reason == "stop"
    eos = demo.engine.model_config.eos_token_ids[0]
    spelled = demo.generate(PROMPT, greedy(2, allowed_token_ids=[eos], skip_special_tokens=False))[
        0
    ].outputs[0]
    assert spelled.token_ids == [eos, eos]
    assert spelled.text == demo.tokenizer.backend.decode([eos, eos], skip_special_tokens=False)
    assert spelled.text, "the demo's EOS has no spelling: the case tests nothing"


def test_truncate_prompt_tokens_keeps_the_prompt_s_end(demo):
    ids = list(range(20, 60))
    short = demo.generate(ids, greedy(4, truncate_prompt_tokens=10))[0]
    assert short.prompt_token_ids == ids[-10:]
    assert short.outputs[0].token_ids == demo.generate(ids[-10:], greedy(4))[0].outputs[0].token_ids


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {5: 101}}, "logit_bias"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"bad_words": [" "]}, "bad_words"),
        ({"n": 0}, "n"),
    ],
)
def test_bad_fields_are_refused_by_name(fields, message):
    with pytest.raises(ValueError, match=f"SamplingParams.{message} must be"):
        SamplingParams(**fields)


def test_token_ids_outside_the_vocabulary_end_only_their_request(demo):
    vocab = demo.engine.model_config.vocab_size
    ok, bias, allowed = demo.generate(
        [PROMPT] * 3,
        [
            greedy(4),
            greedy(4, logit_bias={vocab: 1.0}),
            greedy(4, allowed_token_ids=[1, vocab + 5]),
        ],
    )
    assert len(ok.outputs[0].token_ids) == 4
    assert bias.error.startswith(f"logit_bias: key {vocab} is outside the vocabulary")
    assert allowed.error.startswith(f"allowed_token_ids: token id {vocab + 5} at position 1")
    assert demo.engine.stats().kv_blocks_used == 0
