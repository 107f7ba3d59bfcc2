"""Structured outputs: every output that ends on its own matches its schema, regex,
choice or grammar, with graphs, under every proposer, and greedy output under
speculation equals greedy output without it."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import pytest
import torch

from tests.helpers import greedy
from updraft import LLM, SamplingParams
from updraft.demo import DEMO_DRAFT_DIR
from updraft.engine.grammar_compiler import GrammarCompiler
from updraft.engine.grammar_process import GrammarProcess
from updraft.engine.grammars import Grammars
from updraft.runner.token_mask import mask_logits, unpacked_mask_logits
from updraft.speculative.registry import PROPOSERS, register_proposer
from updraft.step.allowed_tokens import AllowedTokens
from updraft.step.plan import Draft
from updraft.structured_outputs import StructuredOutputsParams

WORDS = ["red", "green", "blue", "alpha", "beta", "gamma", "north", "south", "x", "yes", "no"]
PATTERNS = [r"^[a-z]{1,8}$", r"^\d{3}-\d{4}$", r"^[A-Z][a-z]{0,6}$", r"^(cat|dog)s?$"]
PROMPT = "import json\n\nconfig = "


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A JSON schema of nested objects and arrays, enums, patterns, bounded numbers and
    strings, required and optional fields; always finite (strings and arrays bounded)."""
    kinds = ["string", "integer", "number", "boolean", "enum", "pattern"]
    if depth < 2:
        kinds += ["object", "array"] * 2
    kind = "object" if depth == 0 else rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 12)}
    if kind == "integer":
        low = rng.randint(-100, 100)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 1000)}
    if kind == "number":
        low = rng.uniform(-10, 10)
        return {"type": "number", "minimum": round(low, 2), "maximum": round(low + 50, 2)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(WORDS, rng.randint(1, 4))}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(PATTERNS)}
    if kind == "array":
        return {
            "type": "array",
            "items": random_schema(rng, depth + 1),
            "minItems": rng.randint(0, 1),
            "maxItems": rng.randint(1, 3),
        }
    properties = {f"{rng.choice(WORDS)}_{i}": random_schema(rng, depth + 1) for i in range(4)}
    names = list(properties)[: rng.randint(1, 4)]
    return {
        "type": "object",
        "properties": {name: properties[name] for name in names},
        "required": rng.sample(names, rng.randint(0, len(names))),
        "additionalProperties": False,
    }


def schemas(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [random_schema(rng) for _ in range(count)]


def json_params(schema: dict, **params) -> SamplingParams:
    return SamplingParams(
        structured_outputs=StructuredOutputsParams(json=schema), **{"max_tokens": 200, **params}
    )


def check_json(outputs, schemas_: list[dict]) -> int:
    """Every output that ended on its own validates; returns how many ran out of tokens."""
    cut = 0
    for output, schema in zip(outputs, schemas_, strict=True):
        completion = output.outputs[0]
        assert output.error is None, output.error
        if completion.finish_reason == "length":
            cut += 1
            continue
        assert completion.finish_reason == "stop", completion.finish_reason
        jsonschema.validate(json.loads(completion.text), schema)
    return cut


@pytest.fixture(scope="module")
def demo():
    # Masks computed while the forward runs here, after it in the eager engine below:
    # whichever the thread count would pick, both are tested.
    return LLM(capture_sizes=(1, 2, 4, 8, 16, 32, 64), overlap_grammar_masks=True)


def test_a_hundred_schemas_sampled_together_all_validate(demo):
    specs = schemas(100)
    cut = 0
    for seed in (1, 2):
        params = [
            json_params(s, temperature=1.0, seed=seed * 1000 + i) for i, s in enumerate(specs)
        ]
        outputs = demo.generate([PROMPT] * len(specs), params)
        cut += check_json(outputs, specs)
    assert cut < 0.05 * 2 * len(specs), f"{cut} of {2 * len(specs)} outputs ran out of tokens"
    stats = demo.engine.stats()
    assert "graph" in stats.steps, stats.steps
    assert stats.structured.masked_rows > 0
    assert stats.structured.num_constrained == 0 and stats.kv_blocks_used == 0


@pytest.mark.parametrize("engine", ["eager", "ngram", "draft-model"])
def test_twenty_schemas_validate_eagerly_and_under_speculation(engine, demo):
    specs = schemas(20, seed=3)
    settings = {
        "eager": {"enforce_eager": True, "overlap_grammar_masks": False},
        "ngram": {"speculative_method": "ngram", "num_speculative_tokens": 3},
        "draft-model": {"speculative_model": str(DEMO_DRAFT_DIR), "num_speculative_tokens": 3},
    }[engine]
    llm = LLM(capture_sizes=(1, 2, 4, 8, 16, 32), **settings)
    sampled = llm.generate(
        [PROMPT] * 20, [json_params(s, temperature=1.0, seed=i) for i, s in enumerate(specs)]
    )
    # About one sample in twenty runs out of tokens at temperature 1 (the test above:
    # under 5% of 200). Under speculation which samples do depends on the steps' timing
    # (a request whose mask is late rejoins without drafts), so the bound is the count
    # 20 draws at 5% exceed 1.6% of the time, not the 26% of "at most one"; a grammar
    # that never lets an output end is cut twenty times.
    assert check_json(sampled, specs) <= 3
    greedy_params = [json_params(s, temperature=0) for s in specs]
    plain = demo.generate([PROMPT] * 20, greedy_params)
    assert [o.outputs[0].token_ids for o in llm.generate([PROMPT] * 20, greedy_params)] == [
        o.outputs[0].token_ids for o in plain
    ]
    if engine != "eager":
        assert llm.engine.stats().structured.speculative.rounds > 0


class RandomDrafts:
    """Drafts uniformly random tokens: nearly every one breaks the grammar."""

    wants_hidden_states = False
    runner = None

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.rng = random.Random(0)

    def propose(self, inputs, output, drafting):
        return {
            request.request_id: Draft([self.rng.randrange(self.vocab) for _ in range(limit)])
            for request, limit in drafting
        }


@pytest.fixture
def random_drafts():
    register_proposer("random-drafts", lambda context: RandomDrafts(4096))
    yield
    del PROPOSERS["random-drafts"]


def test_random_drafts_leave_constrained_greedy_output_unchanged(demo, random_drafts):
    specs = schemas(12, seed=5)
    kinds = [StructuredOutputsParams(json=s) for s in specs] + [
        StructuredOutputsParams(regex=r"[a-z]{2,6}( [0-9]+)?\."),
        StructuredOutputsParams(choice=["def", "class", "import os"]),
        StructuredOutputsParams(grammar='start: "(" num ("," num)* ")"\nnum: /[0-9]{1,3}/'),
        StructuredOutputsParams(json_object=True),
    ]
    params = [SamplingParams(temperature=0, max_tokens=120, structured_outputs=k) for k in kinds]
    plain = demo.generate([PROMPT] * len(kinds), params)
    llm = LLM(speculative_method="random-drafts", num_speculative_tokens=3, capture_sizes=(1, 2, 4))
    drafted = llm.generate([PROMPT] * len(kinds), params)
    assert [o.outputs[0].token_ids for o in drafted] == [o.outputs[0].token_ids for o in plain]
    check_json(drafted[: len(specs)], specs)
    stats = llm.engine.stats().structured
    assert stats.speculative.rounds > 0 and stats.speculative.num_draft_tokens > 0


def test_a_forbidden_argmax_under_top_k_one_still_gives_valid_output(demo):
    first = demo.generate(PROMPT, greedy(1))[0].outputs[0].text
    regex = "[0-9]{4}"
    assert not re.fullmatch("[0-9]+", first.strip()), "the free argmax must be forbidden"
    params = SamplingParams(
        temperature=1.0, top_k=1, seed=3, structured_outputs=StructuredOutputsParams(regex=regex)
    )
    output = demo.generate(PROMPT, params)[0].outputs[0]
    assert re.fullmatch(regex, output.text) and output.finish_reason == "stop"


def test_a_preempted_constrained_request_resumes_with_its_grammar_state():
    spec = schemas(1, seed=11)[0]
    params = [json_params(spec, temperature=0) for _ in range(6)]
    roomy = LLM(enforce_eager=True).generate([PROMPT] * 6, params)
    tight = LLM(enforce_eager=True, block_size=4, num_kv_blocks=60, max_num_batched_tokens=64)
    squeezed = tight.generate([PROMPT] * 6, params)
    assert sum(o.metrics.num_preemptions for o in squeezed) > 0
    assert [o.outputs[0].token_ids for o in squeezed] == [o.outputs[0].token_ids for o in roomy]
    check_json(squeezed, [spec] * 6)


def test_logprobs_of_a_constrained_request_are_the_models_own(demo):
    """A choice of one string forces its first token: under the mask its probability is
    1, under the model's own distribution (what logprobs report) it is transformers'."""
    import transformers

    from updraft.demo import DEMO_MODEL_DIR

    spec = StructuredOutputsParams(choice=["zebra crossing"])
    params = SamplingParams(temperature=0, logprobs=True, structured_outputs=spec)
    output = demo.generate(PROMPT, params)[0]
    completion = output.outputs[0]
    assert completion.text == "zebra crossing" and completion.finish_reason == "stop"
    model = transformers.AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32)
    tokens = torch.tensor([output.prompt_token_ids + list(completion.token_ids)])
    with torch.no_grad():
        logprobs = model(tokens).logits[0].log_softmax(-1)
    start = len(output.prompt_token_ids) - 1
    expected = [float(logprobs[start + i, t]) for i, t in enumerate(completion.token_ids)]
    assert completion.logprobs == pytest.approx(expected, abs=1e-3)
    assert completion.logprobs[0] < -0.01


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (StructuredOutputsParams(regex="[a-"), "regex"),
        (StructuredOutputsParams(json="{not json"), "json"),
        (StructuredOutputsParams(grammar="start: undefined_rule"), "grammar"),
        (StructuredOutputsParams(json={"type": "object", "minProperties": "x"}), "json"),
    ],
)
def test_a_spec_that_cannot_compile_ends_its_request_with_a_message(demo, spec, message):
    plain, bad = demo.generate(
        [PROMPT, PROMPT], [greedy(8), SamplingParams(max_tokens=8, structured_outputs=spec)]
    )
    assert plain.error is None and len(plain.outputs[0].token_ids) == 8
    assert bad.outputs[0].finish_reason == "error"
    assert bad.error.startswith(f"structured_outputs.{message}:"), bad.error
    assert demo.engine.stats().kv_blocks_used == 0


def test_a_spec_names_exactly_one_kind():
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=["a", ""])
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"regex": "a"})


def test_a_model_without_a_tokenizer_refuses_structured_outputs(tiny_llama):
    llm = LLM(tiny_llama, enforce_eager=True)
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="a"))
    (output,) = llm.generate([[1, 2, 3]], params)
    assert output.outputs[0].finish_reason == "error" and "tokenizer" in output.error


def grammar_processes() -> list[int]:
    """The grammar processes this test process started (engine/grammar_process.py)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == os.getpid() and b"updraft.engine.grammar_worker" in command:
            pids.append(int(entry.name))
    return pids


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_frozen_grammar_process_does_not_stall_other_requests(demo):
    """The grammar process stopped (SIGSTOP) while a spec waits to compile: a plain
    request runs to its end meanwhile, and once the process goes on the constrained
    request completes."""
    engine = demo.engine
    demo.generate(PROMPT, json_params({"type": "object"}))  # the grammar process runs
    frozen = grammar_processes()
    assert frozen
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)
    try:
        waiting = engine.add_request(PROMPT, json_params({"type": "object", "title": "blocked"}))
        free = engine.add_request(PROMPT, greedy(12))
        finished = {}
        for _ in range(200):
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = output
            if free in finished:
                break
        assert free in finished and waiting not in finished
        assert engine.stats().structured.num_compiling == 1
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
    while engine.has_unfinished:
        for output in engine.step():
            finished[output.request_id] = output
    check_json([finished[waiting]], [{"type": "object", "title": "blocked"}])


def test_a_killed_grammar_process_fails_its_requests_and_the_next_compile_starts_another():
    """The grammar process killed while a constrained request runs: that request ends
    with an error that says so and gives back its KV blocks, a plain one beside it goes
    on, and the next constrained request is served by a new grammar process."""
    before = set(grammar_processes())
    llm = LLM(overlap_grammar_masks=True)
    engine = llm.engine
    llm.generate(PROMPT, json_params({"type": "object"}))
    (first,) = set(grammar_processes()) - before
    slow = engine.add_request(PROMPT, json_params({"type": "array"}, max_tokens=400))
    free = engine.add_request(PROMPT, greedy(40))
    engine.step()
    os.kill(first, signal.SIGKILL)
    finished = {}
    while engine.has_unfinished:
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    assert finished[slow].outputs[0].finish_reason == "error"
    assert "grammar process exited" in finished[slow].error, finished[slow].error
    assert len(finished[free].outputs[0].token_ids) == 40
    assert engine.stats().kv_blocks_used == 0
    (again,) = llm.generate(PROMPT, json_params({"type": "object", "title": "again"}))
    check_json([again], [{"type": "object", "title": "again"}])
    assert set(grammar_processes()) - before - {first}
    engine.close()


@pytest.mark.parametrize("apply", [mask_logits, unpacked_mask_logits])
def test_the_mask_sets_forbidden_tokens_to_minus_infinity(apply):
    """The C kernel and the tensor ops (other devices) alike."""
    torch.manual_seed(0)
    logits = torch.randn(5, 70)
    allowed_sets = {1: {0, 31, 32, 63, 64}, 3: {5, 69}}
    bitmask = torch.zeros(2, 3, dtype=torch.int32)
    for row, tokens in enumerate(allowed_sets.values()):
        for token in tokens:
            bits = bitmask[row, token // 32].item() | (1 << (token % 32))
            bitmask[row, token // 32] = bits - (1 << 32) if bits >= 1 << 31 else bits
    masked = apply(logits, AllowedTokens(torch.tensor([1, 3]), bitmask))
    for row in range(5):
        keep = allowed_sets.get(row, set(range(70)))
        for token in range(70):
            expected = logits[row, token] if token in keep else float("-inf")
            assert masked[row, token] == expected, (row, token)


@contextmanager
def one_grammar(regex: str) -> Iterator[tuple[Grammars, dict[str, int]]]:
    """``Grammars`` over the demo's tokenizer, constraining request "a" by ``regex``, and
    the demo's token ids of single characters."""
    from updraft.demo import DEMO_MODEL_DIR
    from updraft.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(DEMO_MODEL_DIR)
    grammars = Grammars(GrammarProcess(DEMO_MODEL_DIR / "tokenizer.json", 4096, (0,)), False)
    try:
        compiled = grammars.compile(StructuredOutputsParams(regex=regex))
        grammars.wait_compiled([compiled], 60)
        grammars.start("a", compiled.result())
        yield grammars, {text: tokenizer.encode(text)[0] for text in "abcdez"}
    finally:
        grammars.close()


def test_masks_follow_each_draft_and_stop_at_a_forbidden_one():
    with one_grammar("ab(c|d)e") as (grammars, ids):
        sampling = SimpleNamespace(  # the fields allowed_tokens reads
            rows=[0, 1],
            num_drafts=[0, 3],
            draft_token_ids=torch.tensor([[0, 0, 0], [ids["a"], ids["b"], ids["z"]]]),
        )
        inputs = SimpleNamespace(request_ids=["free", "a"], sampling=sampling)
        allowed = grammars.allowed_tokens(inputs)
    assert allowed.rows.tolist() == [1, 2, 3, 4]  # row 0 is the free request's

    def tokens(row):
        return {t for t in range(4096) if (int(allowed.bitmask[row, t // 32]) >> (t % 32)) & 1}

    assert ids["a"] in tokens(0) and ids["b"] not in tokens(0)
    assert ids["b"] in tokens(1)
    assert {ids["c"], ids["d"]} <= tokens(2) and ids["z"] not in tokens(2)
    assert len(tokens(3)) == 4096  # past the forbidden "z": nothing was computed
    assert grammars.accept("a", [ids[c] for c in "abc"]).value == "going"


def test_a_request_ends_where_its_grammar_completes_within_a_step():
    """Drafts that run past the end of the grammar: the step's masks say after which
    draft it is complete, and the request ends there, as it would token by token."""
    with one_grammar("ab") as (grammars, ids):
        sampling = SimpleNamespace(
            rows=[0], num_drafts=[3], draft_token_ids=torch.tensor([[ids["a"], ids["b"], 0]])
        )
        grammars.allowed_tokens(SimpleNamespace(request_ids=["a"], sampling=sampling))
        assert grammars.accept("a", [ids["a"]]).value == "going"
        assert grammars.accept("a", [ids["b"]]).value == "complete"


def test_thousands_of_distinct_schemas_compile_within_a_bounded_cache():
    from updraft.demo import DEMO_MODEL_DIR
    from updraft.engine import grammar_compiler

    compiler = GrammarCompiler(DEMO_MODEL_DIR / "tokenizer.json", 4096, (0,))
    for i in range(2000):
        schema = {"type": "object", "properties": {f"k{i}": {"const": i}}, "required": [f"k{i}"]}
        matcher = compiler.matcher(StructuredOutputsParams(json=schema))
        assert not matcher.is_error()
    assert len(compiler.cached_keys()) == grammar_compiler.CACHE_SIZE


def test_a_grammar_that_starts_after_the_reasoning_is_exact_under_speculation(demo):
    """Free up to the first appearance of its ``starts_after`` tokens, then the schema:
    the same greedy tokens whether drafts come or not, the trigger inside a draft or
    not."""
    free = demo.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    trigger = tuple(free.token_ids[5:7])
    pairs = [tuple(free.token_ids[i : i + 2]) for i in range(len(free.token_ids) - 1)]
    opened = pairs.index(trigger) + 2  # where the grammar starts: after the first
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    spec = StructuredOutputsParams(json=schema, starts_after=trigger)
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs=spec)
    plain = demo.generate(PROMPT, params)[0].outputs[0]
    assert plain.token_ids[:opened] == free.token_ids[:opened]
    answer = demo.tokenizer.decode(plain.token_ids[opened:])
    jsonschema.validate(json.loads(answer), schema)
    assert plain.finish_reason == "stop"
    drafted = LLM(
        speculative_model=str(DEMO_DRAFT_DIR), num_speculative_tokens=3, enforce_eager=True
    )
    assert drafted.generate(PROMPT, params)[0].outputs[0].token_ids == plain.token_ids
    assert drafted.engine.stats().structured.speculative.rounds > 0


def test_logprobs_of_a_verify_step_under_a_grammar_are_the_models_own():
    """A verify step with a grammar and drafts: the n-gram proposer drafts the forced
    choice's tokens out of a prompt that repeats it, so drafts are accepted under the
    mask; each returned logprob, accepted draft or correction, is transformers'
    log-probability of the token (the masked distribution gives every forced token 0),
    and an unconstrained request verified in the same steps keeps its own."""
    import transformers

    from updraft.demo import DEMO_MODEL_DIR

    phrase = " zebra crossing at the old harbour"
    prompt = PROMPT + "#" + phrase * 3 + "\n#"
    llm = LLM(speculative_method="ngram", num_speculative_tokens=3, enforce_eager=True)
    spec = StructuredOutputsParams(choice=[phrase.strip() + phrase])
    params = [
        SamplingParams(temperature=0, logprobs=True, max_tokens=40, structured_outputs=spec),
        SamplingParams(temperature=0, logprobs=True, max_tokens=40),
    ]
    outputs = llm.generate([prompt, prompt], params)
    stats = llm.engine.stats().structured.speculative
    assert sum(stats.accepted) >= 3, stats  # accepted drafts in constrained verify steps
    model = transformers.AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32)
    for output in outputs:
        completion = output.outputs[0]
        tokens = output.prompt_token_ids + list(completion.token_ids)
        with torch.no_grad():
            logprobs = model(torch.tensor([tokens])).logits[0].log_softmax(-1)
        start = len(output.prompt_token_ids) - 1
        expected = [float(logprobs[start + i, t]) for i, t in enumerate(completion.token_ids)]
        assert completion.logprobs == pytest.approx(expected, abs=1e-3)
    constrained = outputs[0].outputs[0]
    assert constrained.text == spec.choice[0] and constrained.finish_reason == "stop"
    assert sum(lp < -0.01 for lp in constrained.logprobs) >= 3, constrained.logprobs
