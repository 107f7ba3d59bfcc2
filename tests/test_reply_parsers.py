"""Each family's own reply syntax, read without a model: tool calls in Mistral's,
DeepSeek's and Phi-4-mini's formats and reasoning in <think> tags, read the same whole
and however the text is cut as it streams; each format chosen from the family's real
chat template (llama.cpp's models/templates); the gate that starts a grammar after the
reasoning, opening at the same token however the tokens arrive."""

from __future__ import annotations

import itertools
import json

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from updraft.chat_template import ChatTemplate
from updraft.engine.grammars import Gate
from updraft.serve.parsers.reasoning import (
    THINK_TAGS,
    ReasoningStream,
    Start,
    default_reasoning,
    reply_start,
)
from updraft.serve.parsers.reply import ReplyReader
from updraft.serve.parsers.tool_parsers import parse, reply_stream
from updraft.serve.parsers.tools import default_parser
from updraft.serve.serving import ServeSettings

from .llama_cpp_tree import llama_cpp_tree
from .test_serve_tools import SCHEMAS, assembled, cut

WEATHER_ARGS = '{"city": "Oslo", "unit": "celsius"}'
TIME_ARGS = '{"zone": "CET"}'
CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def v3_call(name: str, arguments: str) -> str:
    return f"{CALL_BEGIN}function{SEP}{name}\n```json\n{arguments}\n```{CALL_END}"


def array(*calls: tuple[str, str]) -> str:
    return "[" + ", ".join(f'{{"name": "{n}", "arguments": {a}}}' for n, a in calls) + "]"


BOTH = (("get_weather", WEATHER_ARGS), ("get_time", TIME_ARGS))
# parser -> case -> (reply, its content or None for the whole reply, number of calls)
REPLIES = {
    "mistral": {
        "array": (f"[TOOL_CALLS]{array(*BOTH)}", "", 2),
        "named": (
            f"Checking.[TOOL_CALLS]get_weather[ARGS]{WEATHER_ARGS}[TOOL_CALLS]get_time"
            f"[ARGS]{TIME_ARGS}",
            "Checking.",
            2,
        ),
        "call id": (f"[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{TIME_ARGS}", "", 1),
        "malformed": ('[TOOL_CALLS]get_weather[ARGS]{"city": Oslo}', None, 0),
        "unclosed": (f"[TOOL_CALLS]{array(BOTH[1])[:-3]}", None, 0),
        "not a call": ("Use [TOOL_CALLS] wisely, [ARGS] too.", None, 0),
    },
    "deepseek_v3": {
        "v3": (
            f"Checking.{CALLS_BEGIN}{v3_call(*BOTH[0])}\n{v3_call(*BOTH[1])}{CALLS_END}",
            "Checking.",
            2,
        ),
        "v3.1": (f"{CALLS_BEGIN}{CALL_BEGIN}get_time{SEP}{TIME_ARGS}{CALL_END}{CALLS_END}", "", 1),
        "malformed": (f"{CALLS_BEGIN}{v3_call('get_time', '{zone: CET}')}{CALLS_END}", None, 0),
        "unclosed": (f"{CALLS_BEGIN}{CALL_BEGIN}get_time{SEP}" + '{"zone"', None, 0),
    },
    "phi4_mini_json": {
        "calls": (f"functools{array(*BOTH)}", "", 2),
        "text first": (f"Sure. functools{array(BOTH[1])}", "Sure. ", 1),
        "malformed": ('functools[{"name": "get_time", "arguments": "zone"}]', None, 0),
        "a word": ("functools is a module", None, 0),
    },
}
CASES = [(parser, case) for parser, cases in REPLIES.items() for case in sorted(cases)]


@pytest.mark.parametrize(("parser", "case"), CASES)
@settings(max_examples=25)
@given(points=st.lists(st.integers(min_value=0), max_size=12))
def test_calls_read_the_same_whole_and_however_they_stream(parser, case, points):
    text, content, count = REPLIES[parser][case]
    whole_content, whole_calls = parse(reply_stream(parser), text)
    assert whole_content == (text if content is None else content)
    assert len(whole_calls) == count
    for call in whole_calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    stream = reply_stream(parser)
    deltas = [stream.feed(piece) for piece in cut(text, points)] + [stream.finish()]
    assert "".join(d.content for d in deltas) == whole_content
    streamed = [call for d in deltas for call in d.tool_calls]
    assert assembled(streamed) == [(c.name, c.arguments) for c in whole_calls]


# Phi-4-mini-instruct's own template (llama.cpp's tree has none): tools ride in the
# system message between <|tool|> and <|/tool|>.
PHI4_MINI_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' and 'tools' in message "
    "and message['tools'] is not none %}{{ '<|' + message['role'] + '|>' + message['content'] "
    "+ '<|tool|>' + message['tools'] + '<|/tool|>' + '<|end|>' }}{% else %}{{ '<|' + "
    "message['role'] + '|>' + message['content'] + '<|end|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}"
)


def template(name: str) -> str:
    if name == "phi4-mini":
        return PHI4_MINI_TEMPLATE
    return (llama_cpp_tree() / "models" / "templates" / f"{name}.jinja").read_text()


# template -> (its tool-call parser, its reasoning parser)
FAMILIES = {
    "mistralai-Mistral-Nemo-Instruct-2407": ("mistral", None),
    "Mistral-Small-3.2-24B-Instruct-2506": ("mistral", None),
    "unsloth-mistral-Devstral-Small-2507": ("mistral", None),
    "deepseek-ai-DeepSeek-V3.1": ("deepseek_v3", "deepseek_r1"),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": ("deepseek_v3", "deepseek_r1"),
    "llama-cpp-deepseek-r1": ("deepseek_v3", "deepseek_r1"),
    "phi4-mini": ("phi4_mini_json", None),
    "Qwen-Qwen3-0.6B": ("hermes", "qwen3"),
    "Qwen-QwQ-32B": ("hermes", "qwen3"),
    "Qwen-Qwen2.5-7B-Instruct": ("hermes", None),
    "meta-llama-Llama-3.1-8B-Instruct": ("llama3_json", None),
}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_each_family_s_template_chooses_its_parsers(name):
    source = template(name)
    assert (default_parser(source), default_reasoning(source)) == FAMILIES[name]


USER = [{"role": "user", "content": "Weather in Oslo?"}]
# template, template variables -> where the reply starts
STARTS = [
    ("Qwen-Qwen3-0.6B", {}, Start.MAYBE),  # the model writes <think> itself
    ("Qwen-Qwen3-0.6B", {"enable_thinking": False}, Start.AFTER),
    ("Qwen-QwQ-32B", {"enable_thinking": True}, Start.INSIDE),
    ("Qwen-QwQ-32B", {}, Start.AFTER),
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", {"enable_thinking": True}, Start.INSIDE),
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", {}, Start.AFTER),
    ("deepseek-ai-DeepSeek-V3.1", {"thinking": True}, Start.INSIDE),
    ("deepseek-ai-DeepSeek-V3.1", {}, Start.AFTER),
]


@pytest.mark.parametrize(("name", "variables", "start"), STARTS)
def test_the_prompt_says_where_the_reply_starts(name, variables, start):
    prompt = ChatTemplate(source=template(name)).render(USER, template_kwargs=variables)
    assert reply_start(prompt, THINK_TAGS) is start


# start -> reply -> (reasoning, content)
REASONED = {
    (Start.INSIDE, "I should look.\n</think>\n\nIt is sunny."): (
        "I should look.\n",
        "It is sunny.",
    ),
    (Start.INSIDE, "Still thinking </thinking>"): ("Still thinking </thinking>", ""),
    (Start.MAYBE, "<think>\nHmm.</think>Sunny."): ("\nHmm.", "Sunny."),
    (Start.MAYBE, "\n<think>Hmm.</think>\n"): ("Hmm.", ""),
    (Start.MAYBE, "  Sunny <think>"): ("", "  Sunny <think>"),
    (Start.MAYBE, "<thin"): ("", "<thin"),
    (Start.AFTER, "Sunny. <think>x</think>"): ("", "Sunny. <think>x</think>"),
}


@pytest.mark.parametrize("key", list(REASONED), ids=[text for _, text in REASONED])
@settings(max_examples=25)
@given(points=st.lists(st.integers(min_value=0), max_size=10))
def test_reasoning_splits_the_same_whole_and_however_it_streams(key, points):
    start, text = key
    reasoning, content = REASONED[key]
    stream = ReasoningStream(THINK_TAGS, start)
    splits = [stream.feed(piece) for piece in cut(text, points)] + [stream.finish()]
    assert "".join(s.reasoning for s in splits) == reasoning
    assert "".join(s.content for s in splits) == content


@given(points=st.lists(st.integers(min_value=0), max_size=10))
def test_calls_are_read_after_the_reasoning(points):
    call = '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>'
    text = f"<think>The zone is CET.</think>\n\nChecking.{call}"
    reader = ReplyReader(ReasoningStream(THINK_TAGS, Start.MAYBE), reply_stream("hermes"))
    deltas = [reader.feed(piece) for piece in cut(text, points)] + [reader.finish()]
    assert "".join(d.reasoning for d in deltas) == "The zone is CET."
    assert "".join(d.content for d in deltas) == "Checking."
    assert assembled([c for d in deltas for c in d.tool_calls]) == [("get_time", TIME_ARGS)]


@given(
    tokens=st.lists(st.integers(0, 3), max_size=40),
    trigger=st.lists(st.integers(0, 3), min_size=1, max_size=3),
    points=st.lists(st.integers(min_value=0), max_size=10),
    drafts=st.lists(st.integers(0, 3), max_size=4),
)
def test_a_gate_opens_where_its_trigger_first_ends_however_tokens_arrive(
    tokens, trigger, points, drafts
):
    """As Grammars.accept feeds it: chunks of appended tokens; between chunks a step's
    drafts are read through it, which must change nothing."""
    first_end = next(
        (end for end in range(len(trigger), len(tokens) + 1) if tokens[end - len(trigger) : end]
         == trigger),
        None,
    )  # fmt: skip
    gate, seen, opened_at = Gate(tuple(trigger)), 0, None
    edges = sorted({0, len(tokens), *(p % (len(tokens) + 1) for p in points)})
    for a, b in itertools.pairwise(edges):
        before = gate.tail
        gate.opened_by(drafts)
        assert gate.tail == before
        opened = gate.opened_by(tokens[a:b])
        if opened is not None:
            opened_at = seen + opened
            break
        gate.append(tokens[a:b])
        seen += b - a
    assert opened_at == first_end


@pytest.mark.parametrize(
    ("field", "value"), [("tool_call_parser", "pythonic"), ("reasoning_parser", "granite")]
)
def test_a_parser_the_server_does_not_know_is_refused_by_name(field, value):
    with pytest.raises(ValueError, match=f"{field}: '{value}' is not one of"):
        ServeSettings(model_name="m", **{field: value})
