"""Turning chat messages into one prompt string.

A checkpoint's own template comes first: ``chat_template.jinja`` beside the weights, or
``chat_template`` in ``tokenizer_config.json`` (a string, or a list of named templates of
which ``default`` is used). A checkpoint without one, like the demo model, gets
``SIMPLE_CHAT_TEMPLATE``: each message as ``<|role|>``, a newline, its content and a
newline, then ``<|assistant|>`` and a newline for the reply (with tools, a system
message first that lists them, and calls and their results in Hermes-style
``<tool_call>`` and ``<tool_response>`` blocks)::

    <|system|>
    You write Python.
    <|user|>
    Sort a list.
    <|assistant|>

Templates render in jinja2's immutable sandbox, as in transformers, because a
checkpoint's template is code from whoever published the checkpoint.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

SIMPLE_CHAT_TEMPLATE = (
    # With tools: a system message that lists them and says how to call one, in the
    # Hermes style (<tool_call> blocks) that the server's default parser reads.
    "{% if tools %}<|system|>\nYou may call these tools. To call one, write\n<tool_call>\n"
    '{"name": <its name>, "arguments": <its arguments, a JSON object>}\n</tool_call>\n'
    "<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n{% endif %}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n"
    "{% if message['role'] == 'tool' %}"
    "<tool_response>\n{{ message['content'] }}\n</tool_response>\n"
    "{% else %}{{ message['content'] }}\n{% endif %}"
    "{% for call in message['tool_calls'] or [] %}<tool_call>\n"
    "{\"name\": {{ call['function']['name'] | tojson }}, "
    "\"arguments\": {{ call['function']['arguments'] | tojson }}}\n</tool_call>\n"
    "{% endfor %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class ChatTemplateError(ValueError):
    """The messages do not fit the template (the template raised or failed)."""


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str] | None = None) -> None:
        self.source = source
        self.special_tokens = special_tokens or {}
        environment = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        environment.globals["raise_exception"] = _raise_exception
        # As transformers: templates that write today's date (Mistral Small 3.x).
        environment.globals["strftime_now"] = _strftime_now
        # As transformers renders templates: JSON as json.dumps writes it, not jinja2's
        # HTML-safe form (which turns < into \u003c inside a tool's description).
        environment.filters["tojson"] = _tojson
        self._template = environment.from_string(source)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ChatTemplate:
        model_dir = Path(model_dir)
        config: dict[str, Any] = {}
        config_path = model_dir / "tokenizer_config.json"
        if config_path.is_file():
            config = json.loads(config_path.read_text())
        special_tokens = {
            name: _token_text(config.get(name)) for name in ("bos_token", "eos_token")
        }
        jinja_path = model_dir / "chat_template.jinja"
        if jinja_path.is_file():
            return cls(jinja_path.read_text(), special_tokens)
        source = config.get("chat_template")
        if isinstance(source, list):
            named = {entry.get("name"): entry.get("template") for entry in source}
            source = named.get("default")
        return cls(source or SIMPLE_CHAT_TEMPLATE, special_tokens)

    @property
    def spells_special_tokens(self) -> bool:
        """A model's own template writes its BOS and turn tokens into the text, which
        is then encoded without the tokenizer's (a second BOS would change what the
        model reads); updraft's simple template writes none."""
        return self.source != SIMPLE_CHAT_TEMPLATE

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
    ) -> str:
        """``tools``: the functions the model may call (OpenAI's shape), for templates
        that describe them; ``template_kwargs``: more variables for the template (Qwen3's
        ``enable_thinking``), which cannot replace the messages, tools or special
        tokens. ``continue_final_message``: the text ends inside the last message, just
        after its content, so the model goes on with it."""
        text = self._render(messages, add_generation_prompt, template_kwargs, tools)
        if not continue_final_message:
            return text
        final = messages[-1].get("content") or ""
        end = text.rfind(final) if final else -1
        if end < 0:
            raise ChatTemplateError(
                "continue_final_message: the final message needs content that the chat "
                "template writes out"
            )
        return text[: end + len(final)]

    def _render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        template_kwargs: dict[str, Any] | None,
        tools: list[dict[str, Any]] | None,
    ) -> str:
        try:
            variables = {
                **(template_kwargs or {}),
                "messages": messages,
                "tools": tools,
                "add_generation_prompt": add_generation_prompt,
                **self.special_tokens,
            }
            return self._template.render(**variables)
        # Any failure here is about the messages or the template, never the server.
        except Exception as error:
            raise ChatTemplateError(
                f"the chat template cannot render these messages: {error}"
            ) from error


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _token_text(token: object) -> str:
    # tokenizer_config.json writes a token either as its text or as an AddedToken dict.
    if isinstance(token, dict):
        return str(token.get("content", ""))
    return "" if token is None else str(token)
