"""Each family's own tool-call and reasoning formats through the OpenAI SDK: the demo
model served with a family's real chat template (llama.cpp's models/templates) in its
tokenizer_config.json, as a checkpoint or a GGUF file brings it, the server picking the
parsers from the template. The demo model never learned these formats, so its reply is
forced with a regex (the server told to constrain the reasoning too); the reply then
comes back as reasoning_content, content and tool_calls, whole and streamed in
fragments, and a call whose arguments are not JSON comes back as text.

Without that setting a grammar constrains only the answer: the reasoning is the model's
own, the same as with no grammar at all."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import openai
import pytest

from updraft.config import EngineConfig
from updraft.demo import DEMO_MODEL_DIR
from updraft.engine.engine import Engine
from updraft.serve.serving import ServeSettings

from .serving import MODEL, running_server
from .test_reply_parsers import PHI4_MINI_TEMPLATE, template
from .test_serve_tools import CLOCK

ARGS, BROKEN = '{"zone": "CET"}', '{"zone": CET}'
# family -> (template, its variables, reasoning the reply opens with, the call's syntax);
# the other forms each parser reads are tested in test_reply_parsers.py.
FAMILIES = {
    "mistral": ("Mistral-Small-3.2-24B-Instruct-2506", {}, "", "[TOOL_CALLS]get_time[ARGS]{}"),
    "deepseek-r1": (
        "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
        {"enable_thinking": True},  # the prompt opens <think>: the reply starts inside
        "Look it up.\n</think>\n\n",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{}"
        "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    ),
    "phi4-mini": ("phi4-mini", {}, "", 'functools[{{"name": "get_time", "arguments": {}}}]'),
    "qwen3": (
        "Qwen-Qwen3-0.6B",
        {},
        "<think>Look it up.</think>\n",  # the model opens <think> itself
        '<tool_call>{{"name": "get_time", "arguments": {}}}</tool_call>',
    ),
}


@contextmanager
def served(source: str, tmp_path, **settings):
    """The demo model with ``source`` as its chat template, served."""
    model = tmp_path / "model"
    model.mkdir()
    for path in DEMO_MODEL_DIR.iterdir():
        if path.name != "tokenizer_config.json":
            (model / path.name).symlink_to(path)
    config = json.loads((DEMO_MODEL_DIR / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": source}))
    settings = ServeSettings(model_name=MODEL, max_tokens_limit=256, **settings)
    engine = Engine(EngineConfig(model=str(model), enforce_eager=True))
    with running_server(settings, engine) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def forced(client, variables, reply: str, stream: bool = False):
    """The reply to a question about the time, forced to be ``reply``; the chunks, with
    ``stream``."""
    request = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "What time is it in Berlin?"}],
        tools=[CLOCK],
        max_tokens=160,
        temperature=0,
        extra_body={"guided_regex": re.escape(reply), "chat_template_kwargs": variables},
    )
    if stream:
        return list(client.chat.completions.create(**request, stream=True))
    return client.chat.completions.create(**request)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_s_calls_and_reasoning_come_back_plain_and_streamed(family, tmp_path):
    name, variables, reasoning, call = FAMILIES[family]
    source = PHI4_MINI_TEMPLATE if name == "phi4-mini" else template(name)
    reply, broken = (f"{reasoning}Checking. {call.format(a)}" for a in (ARGS, BROKEN))
    with (
        served(source, tmp_path, structured_outputs_in_reasoning=True) as client,
        ThreadPoolExecutor(3) as pool,  # the three requests in one batch
    ):
        whole, chunks, wrong = pool.map(
            lambda ask: forced(client, variables, *ask), [(reply,), (reply, True), (broken,)]
        )
    message = whole.choices[0].message
    thought = getattr(message, "reasoning_content", None)
    between_tags = reasoning.split("</think>")[0].removeprefix("<think>")
    assert thought == (between_tags or None)
    assert message.content == "Checking. "
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [
        ("get_time", ARGS)
    ]
    assert whole.choices[0].finish_reason == "tool_calls"

    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == (thought or "")
    assert "".join(d.content or "" for d in deltas) == message.content
    fragments = [fragment for d in deltas for fragment in d.tool_calls or []]
    assert fragments[0].id.startswith("call_") and fragments[0].function.name == "get_time"
    assert len(fragments) >= 2, "the arguments did not follow the name"
    assert "".join(f.function.arguments or "" for f in fragments) == ARGS
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    assert wrong.choices[0].message.tool_calls is None
    assert wrong.choices[0].message.content == "Checking. " + call.format(BROKEN)
    assert wrong.choices[0].finish_reason == "stop"


def test_a_grammar_leaves_the_reasoning_to_the_model(tmp_path):
    """DeepSeek-R1's prompt opens <think>: with a response_format the reasoning is what
    the model writes without one (the grammar waits for </think>)."""
    source = template("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    formats = [None, {"type": "json_schema", "json_schema": {"name": "ok", "schema": schema}}]
    with served(source, tmp_path) as client:
        replies = [
            client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Is it sunny?"}],
                max_tokens=24,
                temperature=0,
                extra_body={
                    "chat_template_kwargs": {"enable_thinking": True},
                    **({"response_format": f} if f else {}),
                },
            ).choices[0]
            for f in formats
        ]
    free, constrained = (getattr(r.message, "reasoning_content", None) for r in replies)
    assert free and constrained == free
    assert replies[1].message.content is None and replies[1].finish_reason == "length"
