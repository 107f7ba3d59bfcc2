"""Structured outputs over HTTP: OpenAI's response_format through the official SDK (and
its ``parse`` helper), vLLM's structured_outputs and guided_* fields, and specs no
compiler should take answered with a 400, not a 500 or a hung request."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pydantic
import pytest

from updraft.serve.serving import ServeSettings

from .serving import MODEL, running_server, wait_for_idle

MESSAGES = [{"role": "user", "content": "Give me a config as JSON."}]


class Point(pydantic.BaseModel):
    label: str = pydantic.Field(max_length=8)
    x: int = pydantic.Field(ge=0, le=100)
    tags: list[str] = pydantic.Field(max_length=2)


@pytest.fixture(scope="module")
def base_url():
    settings = ServeSettings(model_name=MODEL, max_tokens_limit=256)
    with running_server(settings) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def post(base_url: str, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base_url}/v1/{route}", json={"model": MODEL, **body}, timeout=120)


def test_the_sdk_parses_a_pydantic_model(client):
    completion = client.chat.completions.parse(
        model=MODEL, messages=MESSAGES, response_format=Point, max_tokens=128, temperature=0
    )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Point)
    assert Point.model_validate_json(message.content) == message.parsed


def test_a_streamed_json_schema_response_adds_up_to_valid_json(client):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 10}, "n": {"type": "integer"}},
        "required": ["name", "n"],
        "additionalProperties": False,
    }
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "thing", "schema": schema, "strict": True},
    }
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            response_format=response_format,
            max_tokens=64,
            seed=4,
            stream=True,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), schema)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_json_object_on_both_routes(base_url):
    """Sampled with seeds: greedy, the demo model loops inside its first string."""
    for route in ("chat/completions", "completions"):
        prompt = {"messages": MESSAGES} if route.startswith("chat") else {"prompt": "config = "}
        finished = 0
        for seed in range(4):
            body = {**prompt, "max_tokens": 200, "seed": seed, "temperature": 0.8}
            response = post(base_url, route, {**body, "response_format": {"type": "json_object"}})
            assert response.status_code == 200, response.text
            choice = response.json()["choices"][0]
            text = choice["message"]["content"] if route.startswith("chat") else choice["text"]
            if choice["finish_reason"] == "stop":
                assert isinstance(json.loads(text), dict)
                finished += 1
        assert finished >= 2


@pytest.mark.parametrize(
    ("extra", "check"),
    [
        ({"guided_choice": ["alpha", "beta", "gamma"]}, lambda t: t in {"alpha", "beta", "gamma"}),
        ({"guided_regex": r"[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
        ({"guided_json": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}}, None),
        ({"guided_grammar": 'root ::= "(" [0-9]+ ")"'}, lambda t: re.fullmatch(r"\(\d+\)", t)),
        ({"structured_outputs": {"choice": ["on", "off"]}}, lambda t: t in {"on", "off"}),
        ({"structured_outputs": {"regex": "x+y"}}, lambda t: re.fullmatch("x+y", t)),
    ],
)
def test_vllm_fields_through_extra_body(client, extra, check):
    for create in (client.chat.completions.create, client.completions.create):
        args = {"messages": MESSAGES} if create == client.chat.completions.create else {}
        if not args:
            args["prompt"] = "answer: "
        response = create(model=MODEL, max_tokens=48, temperature=0, extra_body=extra, **args)
        choice = response.choices[0]
        text = choice.message.content if hasattr(choice, "message") else choice.text
        assert choice.finish_reason == "stop", text
        if check is None:
            value = json.loads(text)
            assert isinstance(value, list) and all(isinstance(v, bool) for v in value)
        else:
            assert check(text), text


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"guided_regex": "[a-"}, "guided_regex", "regex"),
        ({"guided_json": "{nope"}, "guided_json", ""),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            None,
            "schema",
        ),
        ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
        ({"structured_outputs": {"structural_tag": {}}}, "structured_outputs", "structural_tag"),
        ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice", "only one"),
        ({"guided_grammar": "start: missing"}, "guided_grammar", "missing"),
        ({"guided_choice": []}, "guided_choice", "exactly one"),
    ],
)
def test_a_spec_that_cannot_be_served_is_a_400_naming_its_field(base_url, body, param, words):
    for route in ("chat/completions", "completions"):
        prompt = {"messages": MESSAGES} if route.startswith("chat") else {"prompt": "x"}
        response = post(base_url, route, {**prompt, "max_tokens": 4, **body})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert param is None or error["param"] == param, error
        assert words in error["message"], error


CLOSED = {"additionalProperties": False}
CITY = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


@pytest.mark.parametrize(
    ("schema", "words"),
    [
        ({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
         "every object must set additionalProperties to false (at /)"),
        ({"type": "object", "properties": {"city": CITY}, "required": ["city"], **CLOSED},
         "every object must set additionalProperties to false (at /properties/city)"),
        ({"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}},
          "required": ["a"], **CLOSED}, "every property must be required, but 'b' is not"),
        ({"type": "object", "properties": {"c": {"$ref": "#/$defs/City"}}, "required": ["c"],
          "$defs": {"City": {**CITY, "additionalProperties": True}}, **CLOSED},
         "additionalProperties to false (at /$defs/City)"),
        ({"anyOf": [{**CITY, **CLOSED}]}, "the root must be an object, not an anyOf"),
        ({"type": "array", "items": {"type": "string"}}, "the root must be an object"),
        ({"type": "object", "properties": {"a": {"allOf": [{"type": "string"}]}},
          "required": ["a"], **CLOSED}, "allOf is not supported (at /properties/a)"),
    ],
)  # fmt: skip
def test_strict_schemas_keep_openais_rules_or_are_a_400_naming_the_rule(base_url, schema, words):
    """strict: true in a json_schema response format and in a tool's function: every
    object closed and every key required, as OpenAI's strict mode asks; where the
    schema breaks a rule, the 400 says which and where."""
    response_format = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    strict = {"response_format": {**response_format, "json_schema": {
        "name": "s", "schema": schema, "strict": True}}}  # fmt: skip
    for route in ("chat/completions", "completions"):
        prompt = {"messages": MESSAGES} if route.startswith("chat") else {"prompt": "x"}
        response = post(base_url, route, {**prompt, "max_tokens": 4, **strict})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "response_format" and words in error["message"], error
    tool = {"type": "function", "function": {"name": "f", "parameters": schema, "strict": True}}
    body = {"messages": MESSAGES, "max_tokens": 4, "tools": [tool]}
    response = post(base_url, "chat/completions", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "tools" and "tools[0].function.parameters" in error["message"]
    assert words in error["message"], error


def test_chat_template_kwargs_reach_the_template(tmp_path):
    import shutil

    from updraft.demo import DEMO_MODEL_DIR

    model = tmp_path / "model"
    shutil.copytree(DEMO_MODEL_DIR, model)
    (model / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}NO THINKING\n{% endif %}"
    )
    from updraft.config import EngineConfig
    from updraft.engine.engine import Engine

    engine = Engine(EngineConfig(model=str(model), enforce_eager=True))
    with running_server(ServeSettings(model_name=MODEL), engine) as url:
        body = {"messages": MESSAGES, "max_tokens": 1, "temperature": 0}
        plain = post(url, "chat/completions", body).json()
        off = post(
            url, "chat/completions", {**body, "chat_template_kwargs": {"enable_thinking": False}}
        )
    assert off.json()["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]


def deeply_nested_body(depth: int) -> bytes:
    """A completion body whose guided_json nests ``depth`` arrays, written by hand (the
    json module will not write what it cannot read back)."""
    schema = '{"type": "array", "items": ' * depth + '{"type": "integer"}' + "}" * depth
    return (
        f'{{"model": "{MODEL}", "prompt": "x", "max_tokens": 8, "guided_json": {schema}}}'.encode()
    )


def hostile_specs() -> list[dict]:
    return [
        {"guided_json": {"enum": [f"value-{i}-" + "x" * 40 for i in range(3000)]}},
        {"guided_regex": "(a|aa|aaa|a*)*" * 40 + "b"},
        {"guided_regex": "[a-z]{1000}{1000}"},
        {"guided_json": {"$ref": "#"}},
        {
            "guided_json": {
                "type": "object",
                "$defs": {"x": {"$ref": "#/$defs/x"}},
                "$ref": "#/$defs/x",
            }
        },
        {"guided_grammar": "start: a\na: a a | " + " | ".join(f'"{i}"' for i in range(2000))},
    ]


def test_hostile_specs_get_a_4xx_or_are_served_and_the_server_stays_up(base_url):
    for depth in (100, 900, 5000):
        response = httpx.post(
            f"{base_url}/v1/completions",
            content=deeply_nested_body(depth),
            headers={"content-type": "application/json"},
            timeout=120,
        )
        assert response.status_code in (200, 400, 422), response.text[:300]
        assert "error" in response.json() or response.json()["choices"]
    for extra in hostile_specs():
        response = post(base_url, "completions", {"prompt": "x", "max_tokens": 8, **extra})
        assert response.status_code in (200, 400), response.text[:300]
        if response.status_code == 400:
            assert response.json()["error"]["param"] == next(iter(extra))
    ok = post(base_url, "completions", {"prompt": "x", "max_tokens": 4, "temperature": 0})
    assert ok.status_code == 200
    wait_for_idle(base_url)


def test_many_distinct_schemas_are_each_served(base_url):
    for i in range(40):
        schema = {
            "type": "object",
            "properties": {f"k{i}": {"enum": [i]}},
            "required": [f"k{i}"],
            "additionalProperties": False,
        }
        response = post(
            base_url, "completions", {"prompt": "x", "max_tokens": 24, "guided_json": schema}
        )
        assert response.status_code == 200, response.text
        assert json.loads(response.json()["choices"][0]["text"]) == {f"k{i}": i}
    wait_for_idle(base_url)
