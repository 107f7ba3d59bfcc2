"""Tool calls: required and named calls constrained by grammar through the openai SDK,
the model's own syntax parsed in auto mode (whole and streamed, however the text is cut),
and earlier calls and their results rendered as transformers renders them."""

from __future__ import annotations

import itertools
import json

import jsonschema
import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel, Field

from updraft import LLM, SamplingParams
from updraft.chat_template import ChatTemplate
from updraft.demo import DEMO_DRAFT_DIR
from updraft.serve.parsers.tool_parsers import HermesStream, Llama3JsonStream, parse
from updraft.serve.parsers.tools import CallStream, required_spec
from updraft.serve.serving import ServeSettings

from .serving import MODEL, running_server

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 12}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def client():
    with running_server(ServeSettings(model_name=MODEL, max_tokens_limit=256)) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def check_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_time"}}]
)
def test_required_and_named_calls_validate_plain_and_streamed(client, choice):
    args = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=choice, max_tokens=128)
    response = client.chat.completions.create(**args, temperature=0)
    message = response.choices[0].message
    assert response.choices[0].finish_reason == "tool_calls"
    assert message.content is None
    check_calls(message.tool_calls)
    if isinstance(choice, dict):
        assert [c.function.name for c in message.tool_calls] == ["get_time"]
    chunks = list(client.chat.completions.create(**args, temperature=0, stream=True))
    calls: dict[int, dict] = {}
    fragments = 0
    for chunk in chunks:
        for delta in chunk.choices[0].delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"name": None, "arguments": "", "id": None})
            call["id"] = call["id"] or delta.id
            call["name"] = call["name"] or (delta.function.name if delta.function else None)
            call["arguments"] += (delta.function.arguments or "") if delta.function else ""
            fragments += 1
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in message.tool_calls
    ]
    assert fragments > 2 * len(calls), "arguments came in one piece, not as they were made"


class City(BaseModel):
    name: str = Field(max_length=12)
    country: str = Field(max_length=12)


class Trip(BaseModel):
    origin: City
    stops: list[City] = Field(max_length=2)


class Node(BaseModel):  # refers to itself: "#/$defs/Node" from within its own definition
    label: str = Field(max_length=8)
    children: list[Node] = Field(max_length=1)


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "Trip"}}, "auto"]
)
def test_nested_pydantic_tools_work_with_every_tool_choice(client, choice):
    """Nested models' schemas hold $defs and refs into them, which must resolve however
    the grammar nests each tool's schema; the calls validate, plain and streamed."""
    tools = [openai.pydantic_function_tool(Trip), openai.pydantic_function_tool(Node)]
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in tools}
    assert all("$defs" in schema for schema in schemas.values())
    args = dict(model=MODEL, messages=MESSAGES, tools=tools, tool_choice=choice)
    max_tokens = 16 if choice == "auto" else 200  # auto: free text, only its start matters
    args.update(max_tokens=max_tokens, temperature=0, parallel_tool_calls=False)
    message = client.chat.completions.create(**args).choices[0].message
    chunks = list(client.chat.completions.create(**args, stream=True))
    streamed: dict[int, list[str]] = {}
    for chunk in chunks:
        for delta in chunk.choices[0].delta.tool_calls or []:
            call = streamed.setdefault(delta.index, ["", ""])
            call[0] += (delta.function.name or "") if delta.function else ""
            call[1] += (delta.function.arguments or "") if delta.function else ""
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    assert [tuple(call) for call in streamed.values()] == calls
    if choice == "auto":  # the demo model writes no call of its own; nothing is refused
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
        return
    assert chunks[-1].choices[0].finish_reason == "tool_calls" and len(calls) == 1
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), schemas[name])
    if isinstance(choice, dict):
        assert calls[0][0] == "Trip"


def test_a_required_spec_with_refs_accepts_what_each_tool_schema_accepts():
    """Moved under the spec's root, a tool's schema accepts exactly what it accepted
    before (jsonschema judges both): refs to "#", to "definitions" (a key with "/") and
    to another property resolve as they did."""
    tree = {
        "type": "object",
        "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#"}}},
        "required": ["v"],
    }
    old = {
        "type": "object",
        "definitions": {"a/b": {"type": "string", "maxLength": 3}},
        "properties": {"x": {"$ref": "#/definitions/a~1b"}, "y": {"$ref": "#/properties/x"}},
        "required": ["x"],
    }
    tools = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in
             (("tree", tree), ("old", old), ("get_time", SCHEMAS["get_time"]))]  # fmt: skip
    spec = required_spec(tools, "required", parallel=True).json
    cases = [
        ("tree", {"v": 1, "kids": [{"v": 2, "kids": []}]}),
        ("tree", {"v": 1, "kids": [{"kids": []}]}),
        ("old", {"x": "abc", "y": "de"}),
        ("old", {"x": "abc", "y": "long"}),
        ("old", {"x": "long"}),
        ("get_time", {"zone": "UTC"}),
        ("get_time", {"zone": 5}),
    ]
    schemas = {"tree": tree, "old": old, "get_time": SCHEMAS["get_time"]}
    for name, arguments in cases:
        alone = jsonschema.Draft202012Validator(schemas[name]).is_valid(arguments)
        call = [{"name": name, "parameters": arguments}]
        assert jsonschema.Draft202012Validator(spec).is_valid(call) == alone, (name, arguments)
    assert sum(jsonschema.Draft202012Validator(spec).is_valid(
        [{"name": n, "parameters": a}]) for n, a in cases) == 3  # fmt: skip


def test_parallel_calls_each_validate(client):
    """Sampled over seeds, some replies call twice; every call validates."""
    counts = []
    for seed in range(6):
        response = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
            max_tokens=200, seed=seed,
        )  # fmt: skip
        assert response.choices[0].finish_reason == "tool_calls"
        check_calls(response.choices[0].message.tool_calls)
        counts.append(len(response.choices[0].message.tool_calls))
    assert max(counts) >= 2, counts


def one_required_call(client, **sampling):
    return client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=128,
        **sampling,
    )


def test_one_call_unless_parallel_calls_are_allowed(client):
    for seed in (2, 3, 5):  # seeds that call twice when allowed to
        response = one_required_call(client, seed=seed)
        check_calls(response.choices[0].message.tool_calls)
        assert len(response.choices[0].message.tool_calls) == 1


def test_a_call_and_its_result_go_back_through_the_template(client):
    first = one_required_call(client, temperature=0)
    assert first.choices[0].finish_reason == "tool_calls"
    call = first.choices[0].message.tool_calls[0]
    follow_up = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    args = dict(model=MODEL, tools=TOOLS, tool_choice="none", max_tokens=8)
    before = client.chat.completions.create(messages=MESSAGES, **args)
    after = client.chat.completions.create(messages=follow_up, **args)
    assert after.choices[0].message.tool_calls is None
    # the call (its arguments as JSON) and the result, rendered as the template says
    extra = '\n<tool_call>\n{"name": "' + call.function.name + '", "arguments": '
    extra += json.dumps(json.loads(call.function.arguments)) + "}\n</tool_call>\n"
    extra += '<|tool|>\n<tool_response>\n{"temperature": 21}\n</tool_response>\n'
    grown = after.usage.prompt_tokens - before.usage.prompt_tokens
    assert grown >= len(extra) // 8, (grown, extra)


def test_auto_mode_parses_the_models_own_syntax(client):
    """The demo model never learned tools: its reply is forced to a Hermes-style call
    with a regex, which auto mode then reads as a call."""
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
    text += '"unit": "celsius"}}\n</tool_call>'
    regex = "".join("\\" + c if c in r"\.^$*+?{}[]|()" else c for c in text)
    args = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=128, temperature=0)
    extra = {"guided_regex": regex}
    whole = client.chat.completions.create(**args, extra_body=extra)
    message = whole.choices[0].message
    assert message.content == "Let me look.\n"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Oslo", "unit": "celsius"})
    ]
    assert whole.choices[0].finish_reason == "tool_calls"
    chunks = list(client.chat.completions.create(**args, extra_body=extra, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == "Let me look.\n"
    assert "<tool_call>" not in content


def test_tool_choice_none_and_bad_tool_fields_are_handled(client):
    plain = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=8
    )
    assert plain.choices[0].message.tool_calls is None
    bad = [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "tool_choice"),
    ]  # fmt: skip
    for extra, param in bad:
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=4, extra_body=extra
            )
        assert param in str(error.value), (extra, error.value)


CALL_A = '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}'
CALL_B = '{"name": "get_time", "arguments": {"zone": "CET"}}'
REPLIES = {
    "one call": (f"<tool_call>\n{CALL_A}\n</tool_call>", "", 1),
    "text first": (f"Checking.\n<tool_call>\n{CALL_A}\n</tool_call>", "Checking.\n", 1),
    "two calls": (f"<tool_call>{CALL_A}</tool_call>\n<tool_call>{CALL_B}</tool_call>", "\n", 2),
    "malformed": ('<tool_call>{"name": "get_weather", "arg</tool_call>', None, 0),
    "unclosed": (f"<tool_call>\n{CALL_B}", "", 1),
    "no call": ("a < b and <tool but no call", None, 0),
}


def cut(text: str, points: list[int]) -> list[str]:
    edges = sorted({0, len(text), *(p % (len(text) + 1) for p in points)})
    return [text[a:b] for a, b in itertools.pairwise(edges)]


def assembled(tool_call_deltas: list[dict]) -> list[tuple[str, str]]:
    """(name, arguments) of each call, put together from its deltas as a client does:
    the first names it, the rest add argument fragments."""
    calls: dict[int, list[str]] = {}
    for delta in tool_call_deltas:
        if delta["index"] not in calls:
            assert delta["id"].startswith("call_") and delta["function"]["name"]
            calls[delta["index"]] = [delta["function"]["name"], ""]
        calls[delta["index"]][1] += delta["function"].get("arguments", "")
    return [tuple(call) for call in calls.values()]


@pytest.mark.parametrize("case", sorted(REPLIES))
@given(points=st.lists(st.integers(min_value=0), max_size=12))
def test_hermes_replies_read_the_same_however_they_stream(case, points):
    text, content, count = REPLIES[case]
    whole_content, whole_calls = parse(HermesStream(), text)
    assert whole_content == (text if content is None else content)
    assert len(whole_calls) == count
    stream = HermesStream()
    deltas = [stream.feed(piece) for piece in cut(text, points)] + [stream.finish()]
    assert "".join(d.content for d in deltas) == whole_content
    streamed = [call for d in deltas for call in d.tool_calls]
    assert assembled(streamed) == [(c.name, c.arguments) for c in whole_calls]
    for call in whole_calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_llama3_json_replies_are_calls_or_content():
    calls = '{"name": "get_time", "parameters": {"zone": "CET"}}; ' + CALL_A
    content, parsed = parse(Llama3JsonStream(), calls)
    assert content == "" and [c.name for c in parsed] == ["get_time", "get_weather"]
    for text in ("It is sunny.", '{"name": "x"', '{"not": "a call"}'):
        assert parse(Llama3JsonStream(), text) == (text, [])


@given(points=st.lists(st.integers(min_value=0), max_size=12))
def test_a_required_array_streams_names_then_argument_fragments(points):
    text = (
        '[{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}, '
        '{"name": "get_time", "parameters": {"zone": "CET"}}]'
    )
    stream = CallStream()
    deltas = [stream.feed(piece) for piece in cut(text, points)] + [stream.finish()]
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        for call in delta.tool_calls:
            entry = calls.setdefault(call["index"], [call["function"].get("name"), ""])
            entry[1] += call["function"].get("arguments", "")
    assert [(n, json.loads(a)) for n, a in calls.values()] == [
        ("get_weather", {"city": "Oslo", "unit": "celsius"}),
        ("get_time", {"zone": "CET"}),
    ]


def test_greedy_tool_calls_are_the_same_with_and_without_speculation():
    spec = required_spec(TOOLS, "required", parallel=True)
    params = SamplingParams(temperature=0, max_tokens=128, structured_outputs=spec)
    prompt = ChatTemplate.from_dir(DEMO_DRAFT_DIR).render(MESSAGES, tools=TOOLS)
    plain = LLM(enforce_eager=True).generate(prompt, params)[0].outputs[0]
    drafted = LLM(speculative_model=str(DEMO_DRAFT_DIR), num_speculative_tokens=3)
    speculative = drafted.generate(prompt, params)[0].outputs[0]
    assert speculative.token_ids == plain.token_ids
    assert drafted.engine.stats().structured.speculative.rounds > 0
    calls = json.loads(plain.text)
    for call in calls:
        jsonschema.validate(call["parameters"], SCHEMAS[call["name"]])


# A chat template in the Qwen style (ChatML turns, tools listed in the system turn, calls
# in <tool_call> blocks, results as user turns in <tool_response> blocks).
QWEN_STYLE = (
    "{%- if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions.\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\n"
    "For each call, return a JSON object within <tool_call></tool_call> tags.<|im_end|>\n"
    "{%- elif messages[0]['role'] == 'system' %}"
    "<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{%- elif message.role == 'assistant' %}<|im_start|>assistant"
    "{% if message.content %}\n{{ message.content }}{% endif %}"
    "{%- for call in message.tool_calls or [] %}\n<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ message.content }}\n</tool_response><|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


def test_calls_and_results_render_as_transformers_renders_them():
    import transformers

    from updraft.demo import DEMO_MODEL_DIR
    from updraft.serve.chat.protocol import ChatMessage

    arguments = {"city": "Oslo", "unit": "celsius"}
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather"}}
    sent_call = {**call, "function": {**call["function"], "arguments": json.dumps(arguments)}}
    sent = [
        {"role": "system", "content": "Be brief. <b>bold</b> & 'quoted'"},
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [sent_call],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    ours = ChatTemplate(QWEN_STYLE).render(
        [ChatMessage.model_validate(m).for_template() for m in sent], tools=TOOLS
    )
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(DEMO_MODEL_DIR / "tokenizer.json"), chat_template=QWEN_STYLE
    )
    theirs_messages = [dict(m) for m in sent]
    theirs_messages[2] = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{**call, "function": {**call["function"], "arguments": arguments}}],
    }
    theirs = tokenizer.apply_chat_template(
        theirs_messages, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert ours == theirs
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"' in ours
