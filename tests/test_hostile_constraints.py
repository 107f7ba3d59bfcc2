"""Constraints chosen to hurt: a grammar whose masks are slow never holds the other
streams' steps, and constraints that allow no output end with an error that says so,
never with a `stop` on an end of sequence the mask excluded."""

from __future__ import annotations

import statistics
import time

import httpx
import pytest

from tests.helpers import greedy
from updraft import LLM, SamplingParams
from updraft.demo import DEMO_MODEL_DIR
from updraft.engine import grammar_compiler
from updraft.engine.grammar_compiler import GrammarCompiler, GrammarError
from updraft.structured_outputs import StructuredOutputsParams

from .serving import MODEL, running_server

PROMPT = "x = "
# llguidance's lexer spends about a second on this one's first masks before it gives up.
STALLING_REGEX = "a{1000}{1000}b123"
# Every mask of this one costs llguidance about 15 ms, its per-mask fuel: many steps.
SLOW_REGEX = "x(a{300}{300}b)"
MUTUAL_REFS = {
    "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
    "$ref": "#/$defs/a",
}
# (spec, extra sampling fields): each allows no output at all.
SOLO_STEPS = 150
# llguidance keeps the GIL through some of its calls (a lexer step of a slow grammar):
# up to about 40 ms measured beside a Python thread. A step outside its forward may be
# held that long by the mask thread however the engine waits; waiting for a late mask
# would hold it for the mask's whole time (the stalling one's: 100 ms and more).
GIL_HOLD_SECONDS = 0.04
IMPOSSIBLE = {
    "regex-and-allowed-ids": (
        StructuredOutputsParams(regex="[0-9]{3}"),
        {"allowed_token_ids": [1]},
    ),
    "self-ref": (StructuredOutputsParams(json={"$ref": "#"}), {}),
    "mutual-refs": (StructuredOutputsParams(json=MUTUAL_REFS), {}),
    "empty-class": (StructuredOutputsParams(regex=r"[^\s\S]"), {}),
}


@pytest.fixture(scope="module")
def demo():
    return LLM(overlap_grammar_masks=True)


def attack(engine, stream: str, suffix: str) -> tuple[list, list, dict]:
    """The stream's steps before and while a request with the stalling regex and one
    with the slow regex (made new by ``suffix``) run beside it, each as (time since the
    stream's last token, of it the forward's), and the attackers' last outputs."""
    steps = []

    def step() -> dict:
        start, forward = time.perf_counter(), engine.stats().phase_seconds.get("forward", 0.0)
        outputs = {output.request_id: output for output in engine.step()}
        if stream in outputs:
            forward = engine.stats().phase_seconds["forward"] - forward
            steps.append((time.perf_counter() - start, forward))
        return outputs

    for _ in range(SOLO_STEPS):
        step()
    solo = steps[10:]
    specs = [
        StructuredOutputsParams(regex=regex + suffix) for regex in (STALLING_REGEX, SLOW_REGEX)
    ]
    hostile = [
        engine.add_request(PROMPT, SamplingParams(max_tokens=6, structured_outputs=spec))
        for spec in specs
    ]
    attack_from = len(steps)
    finished = {}
    while len(finished) < len(hostile):
        for request_id, output in step().items():
            if request_id in hostile and output.finished:
                finished[request_id] = output
    return solo, steps[attack_from:], [finished[request_id] for request_id in hostile]


def test_slow_grammars_never_hold_a_running_stream(demo):
    """A stream's steps while requests with the stalling and the slow regex run beside
    it: those masks take many of its steps each, they are computed while the stream
    goes on, and their requests wait out of the batch until they are ready (before,
    every step waited for them: gaps of the masks' length).

    Measured in one run against the same stream's steps before the attack. What a step
    spends outside its forward (where a wait for a mask would be) stays under twice the
    stream's median step, or under twice the largest such time of as many steps before
    the attack (a loaded machine stalls any step now and then), or under the longest
    time llguidance keeps the GIL (``GIL_HOLD_SECONDS``); on a loaded machine one of
    three attacks must show it. The forward itself is not held to it: with no spare
    core the mask thread's work slows it down, as any other process would."""
    engine = demo.engine
    late_before = engine.stats().structured.late_masks
    stream = engine.add_request(
        PROMPT, SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)
    )
    try:
        held = attacks(engine, stream)
    finally:
        engine.abort(stream)
        while engine.has_unfinished:
            engine.step()
    assert all(h < bound(median, noise) for h, median, noise in held[-1:]), held
    assert engine.stats().structured.late_masks > late_before  # they did miss steps
    assert engine.stats().kv_blocks_used == 0


def attacks(engine, stream: str) -> list[tuple[float, float, float]]:
    """Up to three attacks, until one shows no step held: per attack, the most a step
    spent outside its forward, the median step before and the noise."""
    held = []
    for attempt in range(3):
        solo, attacked, (stalling, slow) = attack(engine, stream, suffix=str(attempt))
        # llguidance gives up on its lexer, or (on a machine too loaded for that to come
        # within the limit) the first mask is over the time limit.
        assert stalling.outputs[0].finish_reason == "error"
        assert "lexer" in stalling.error or "limit" in stalling.error, stalling.error
        assert slow.outputs[0].finish_reason == "length", slow
        assert slow.outputs[0].text.startswith("xa"), slow
        median = statistics.median(gap for gap, _ in solo)
        noise = max(gap - forward for gap, forward in solo[: len(attacked)])
        held.append((max(gap - forward for gap, forward in attacked), median, noise))
        if held[-1][0] < bound(median, noise):
            break
    return held


def bound(median: float, noise: float) -> float:
    """The most a step may spend outside its forward while masks are late."""
    return max(2 * max(median, noise), GIL_HOLD_SECONDS)


def test_impossible_constraints_end_with_an_error_not_a_stop(demo):
    """Each spec allows no output at all: the request ends with an error that says so
    (a spec llguidance can tell is impossible already at compile), with no token and no
    KV block left, while a plain request in the same steps goes on."""
    names = list(IMPOSSIBLE)
    params = [greedy(8)] + [
        SamplingParams(max_tokens=8, structured_outputs=spec, **extra)
        for spec, extra in IMPOSSIBLE.values()
    ]
    plain, *refused = demo.generate([PROMPT] * len(params), params)
    assert plain.error is None and len(plain.outputs[0].token_ids) == 8
    for name, output in zip(names, refused, strict=True):
        completion = output.outputs[0]
        assert completion.finish_reason == "error", (name, completion)
        assert completion.token_ids == [] and completion.text == "", (name, completion)
        assert output.error.startswith("structured_outputs"), (name, output.error)
        expected = "no token is allowed" if "allowed" in name else "no output can match"
        assert expected in output.error, (name, output.error)
    assert demo.engine.stats().kv_blocks_used == 0


def test_settings_that_forbid_every_token_end_with_an_error(demo):
    """No grammar: allowed_token_ids of only the end of sequence with a min_tokens
    that forbids it leave no token; the error names both settings."""
    eos = demo.engine.model_config.eos_token_ids[0]
    params = SamplingParams(max_tokens=4, allowed_token_ids=[eos], min_tokens=2)
    (output,) = demo.generate([PROMPT], params)
    assert output.outputs[0].finish_reason == "error" and output.outputs[0].token_ids == []
    assert "allowed_token_ids, min_tokens" in output.error, output.error


@pytest.fixture(scope="module")
def base_url():
    with running_server() as url:
        yield url


@pytest.mark.parametrize("name", list(IMPOSSIBLE))
@pytest.mark.parametrize("stream", [False, True])
def test_an_impossible_constraint_is_a_400_on_completions(base_url, name, stream):
    spec, extra = IMPOSSIBLE[name]
    ((kind, value),) = (
        (k, v) for k, v in vars(spec).items() if k in ("json", "regex") and v is not None
    )
    guided = {"json": "guided_json", "regex": "guided_regex"}[kind]
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, guided: value, "stream": stream}
    response = httpx.post(f"{base_url}/v1/completions", json={**body, **extra}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == guided, error
    assert "no token is allowed" in error["message"] or "no output can match" in error["message"]


def test_the_mask_limit_counts_the_threads_cpu_time(monkeypatch):
    """A grammar's first mask is refused for what it costs in its thread's CPU time, not
    for the wall time its lower-priority thread may spend waiting for a core on a busy
    machine: a thread clock that says 5 s passed refuses it, naming the CPU time."""
    compiler = GrammarCompiler(DEMO_MODEL_DIR / "tokenizer.json", 4096, (0,))
    real = time.thread_time
    costs = iter([0.0, 5.0])  # the first mask's start and end
    monkeypatch.setattr(grammar_compiler.time, "thread_time", lambda: next(costs, real()))
    try:
        with pytest.raises(GrammarError, match=r"5\.00 s of CPU, over the limit"):
            compiler.submit(StructuredOutputsParams(regex="[0-9]{4}")).result(timeout=60)
    finally:
        compiler.close()
