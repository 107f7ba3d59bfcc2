"""The OpenAI-compatible API, through the official openai client and raw HTTP."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.helpers import greedy
from updraft import LLM
from updraft.chat_template import SIMPLE_CHAT_TEMPLATE, ChatTemplate
from updraft.serve.serving import ServeSettings

from .serving import MODEL, metric, running_server, wait_for_idle

PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def base_url():
    settings = ServeSettings(model_name=MODEL, max_tokens_limit=256, max_request_bytes=64 * 1024)
    with running_server(settings) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def llm():
    return LLM()


def complete_greedily(llm: LLM, prompt: str, max_tokens: int, **params):
    return llm.generate(prompt, greedy(max_tokens, ignore_eos=False, **params))[0]


def test_greedy_completion_over_http_equals_llm_generate(client, llm):
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    reference = complete_greedily(llm, PROMPT, 24)
    choice = response.choices[0]
    assert choice.text == reference.outputs[0].text
    assert choice.finish_reason == "length"
    assert response.usage.prompt_tokens == len(reference.prompt_token_ids)
    assert response.usage.completion_tokens == 24
    assert response.usage.total_tokens == response.usage.prompt_tokens + 24


def test_streamed_completion_adds_up_to_the_same_text_and_usage(client, llm):
    stream = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    assert text == complete_greedily(llm, PROMPT, 24).outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24


def test_return_token_ids_streams_every_token_of_a_token_id_prompt(base_url, llm):
    """vLLM's return_token_ids: with a token-id prompt each chunk names its new token
    ids, so a client sees every token arrive even where no text is printable; without
    it, responses carry no token_ids field."""
    prompt = llm.tokenizer.encode(PROMPT)
    reference = llm.generate(prompt, greedy(12, ignore_eos=False))[0].outputs[0]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0}
    plain = httpx.post(f"{base_url}/v1/completions", json=body).json()
    assert "token_ids" not in plain["choices"][0]
    whole = httpx.post(f"{base_url}/v1/completions", json={**body, "return_token_ids": True})
    assert whole.json()["choices"][0]["token_ids"] == list(reference.token_ids)
    streamed = []
    with httpx.stream(
        "POST",
        f"{base_url}/v1/completions",
        json={**body, "return_token_ids": True, "stream": True},
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                streamed.append(json.loads(line.removeprefix("data: "))["choices"][0]["token_ids"])
    assert [t for chunk in streamed for t in chunk] == list(reference.token_ids)
    assert all(streamed[:-1])  # no empty chunk before the end


def test_stream_is_server_sent_events_ending_in_done(base_url):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in events)
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(line.removeprefix("data: ")) for line in events[:-1]]
    assert all(p["object"] == "text_completion" and p["usage"] is None for p in payloads)


def test_chat_uses_the_demo_template_and_matches_llm_generate(client, llm):
    messages = [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "Sort a list."},
    ]
    response = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0
    )
    prompt = "<|system|>\nYou write Python.\n<|user|>\nSort a list.\n<|assistant|>\n"
    assert ChatTemplate(SIMPLE_CHAT_TEMPLATE).render(messages) == prompt
    reference = complete_greedily(llm, prompt, 16)
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == reference.outputs[0].text
    assert response.usage.prompt_tokens == len(reference.prompt_token_ids)
    assert response.usage.completion_tokens == len(reference.outputs[0].token_ids)


def test_streamed_chat_starts_with_the_role_and_adds_up(client):
    messages = [{"role": "user", "content": [{"type": "text", "text": "import os"}]}]
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_a_checkpoint_template_is_used_when_it_has_one(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "eos_token": "</s>",
                "chat_template": "{% for m in messages %}[{{ m.role }}] {{ m.content }}"
                "{{ eos_token }}{% endfor %}",
            }
        )
    )
    template = ChatTemplate.from_dir(tmp_path)
    assert template.render([{"role": "user", "content": "hi"}]) == "[user] hi</s>"


def test_sampling_parameters_and_logprobs(client, llm):
    seeded = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0.9, top_p=0.9, seed=7)
    first = client.completions.create(**seeded, extra_body={"top_k": 50, "min_p": 0.05})
    again = client.completions.create(**seeded, extra_body={"top_k": 50, "min_p": 0.05})
    assert first.choices[0].text == again.choices[0].text  # a seed fixes the sample
    with_logprobs = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0, user="someone"
    )
    logprobs = with_logprobs.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 6
    assert all(lp <= 0 for lp in logprobs.token_logprobs)
    reference = llm.generate(PROMPT, greedy(6, ignore_eos=False, logprobs=True))
    assert logprobs.token_logprobs == pytest.approx(reference[0].outputs[0].logprobs, abs=1e-4)


def test_stop_strings_end_the_text(client):
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=64, temperature=0, stop=["Return"]
    )
    assert response.choices[0].finish_reason == "stop"
    assert "Return" not in response.choices[0].text


def test_models_health_and_metrics(base_url, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{base_url}/health").status_code == 200
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3)
    text = httpx.get(f"{base_url}/metrics").text
    for name in (
        "updraft_num_requests_running",
        "updraft_num_requests_waiting",
        "updraft_kv_cache_used_blocks",
        "updraft_prompt_tokens_total",
        "updraft_generation_tokens_total",
        "updraft_time_to_first_token_seconds_bucket",
        "updraft_inter_token_latency_seconds_bucket",
    ):
        assert name in text
    assert metric(base_url, "updraft_generation_tokens_total") >= 3
    wait_for_idle(base_url)


BAD_REQUESTS = [
    # (body, status, param named)
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    ({"prompt": "x"}, 400, "model"),
    ({"model": MODEL}, 400, "prompt"),
    ({"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ({"model": MODEL, "prompt": ""}, 400, "prompt"),
    ({"model": MODEL, "prompt": [5000]}, 400, "prompt"),
    # Checked before anything decodes them: a negative id would overflow the detokenizer.
    ({"model": MODEL, "prompt": [[-1, 5]]}, 400, "prompt"),
    ({"model": MODEL, "prompt": [[5, 99999999]]}, 400, "prompt"),
    ({"model": MODEL, "prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 10**12}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": "8"}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"model": MODEL, "prompt": "x", "top_k": 10**30}, 400, "top_k"),
    ({"model": MODEL, "prompt": "x", "seed": 2**70}, 400, "seed"),
    ({"model": MODEL, "prompt": "x", "stop": [""]}, 400, "stop"),
    ({"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
    ({"model": MODEL, "prompt": "x", "n": 129}, 400, "n"),
    ({"model": MODEL, "prompt": ["a", "b"], "n": 65}, 400, "prompt"),  # 130 sequences
    ({"model": MODEL, "prompt": []}, 400, "prompt"),
    ({"model": MODEL, "prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ({"model": MODEL, "prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"5": 200}}, 400, "logit_bias"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"99999": 1}}, 400, "logit_bias"),
    ({"model": MODEL, "prompt": "x", "min_tokens": 9, "max_tokens": 4}, 400, "min_tokens"),
    ({"model": MODEL, "prompt": "x", "allowed_token_ids": []}, 400, "allowed_token_ids"),
    ({"model": MODEL, "prompt": "x", "bad_words": ["  "]}, 400, "bad_words"),
    ({"model": MODEL, "prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ({"model": MODEL, "prompt": "x", "best_of": 2}, 400, "best_of"),
    ({"model": MODEL, "prompt": "x", "suffix": "y"}, 400, "suffix"),
    ({"model": MODEL, "prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 2047}, 400, "max_tokens"),  # prompt + it
    ({"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}}, 400, None),
    ({"model": MODEL, "prompt": "x " * 2100}, 400, "prompt"),  # over the context length
    ({"model": MODEL, "prompt": "x " * 2100, "stream": True}, 400, "prompt"),
]


@pytest.mark.parametrize(("body", "status", "param"), BAD_REQUESTS)
def test_bad_completions_get_an_openai_error_naming_the_field(base_url, body, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(
        f"{base_url}/v1/completions",
        content=content,
        headers={"content-type": "application/json"},
    )
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param and param in error["message"]


@pytest.mark.parametrize(
    ("messages", "param"),
    [([], "messages"), ([{"role": "wizard", "content": "x"}], "messages"), ("hi", "messages")],
)
def test_bad_chat_requests_name_the_field(base_url, messages, param):
    body = {"model": MODEL, "messages": messages}
    response = httpx.post(f"{base_url}/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


def test_the_openai_client_sees_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x")
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=0)


def test_a_body_over_the_limit_is_413(base_url):
    body = {"model": MODEL, "prompt": "x" * (70 * 1024)}
    response = httpx.post(f"{base_url}/v1/completions", json=body)
    assert response.status_code == 413
    assert response.json()["error"]["type"] == "invalid_request_error"

    def chunked():  # no Content-Length: the limit holds while reading
        yield b'{"model": "updraft-demo", "prompt": "'
        for _ in range(80):
            yield b"x" * 1024
        yield b'"}'

    response = httpx.post(f"{base_url}/v1/completions", content=chunked())
    assert response.status_code == 413


def test_bad_requests_leave_the_server_serving(base_url, client):
    for _ in range(3):
        httpx.post(f"{base_url}/v1/completions", content=b"\xff\xfe garbage")
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
    assert response.usage.completion_tokens == 4
    wait_for_idle(base_url)


def test_serve_help_never_prints_the_api_key(monkeypatch, capsys):
    from updraft.cli import main

    monkeypatch.setenv("UPDRAFT_API_KEY", "topsecret")
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    help_text = capsys.readouterr().out
    assert "--api-key" in help_text and "topsecret" not in help_text


def test_every_error_status_is_counted(base_url):
    def rejected(status: int) -> float:
        return metric(base_url, "updraft_request_rejected_total", f'status="{status}"')

    before = {status: rejected(status) for status in (400, 404, 413, 415)}
    url = f"{base_url}/v1/completions"
    httpx.post(url, json={"model": MODEL, "prompt": "x", "temperature": -1})
    httpx.post(url, json={"model": "gpt-4", "prompt": "x"})
    httpx.post(url, json={"model": MODEL, "prompt": "x" * 70_000})  # over 64 KiB
    httpx.post(url, content=b"prompt=x", headers={"content-type": "text/plain"})
    httpx.get(f"{base_url}/v1/nothing-here")
    after = {status: rejected(status) for status in (400, 404, 413, 415)}
    assert {s: after[s] - before[s] for s in after} == {400: 1, 404: 2, 413: 1, 415: 1}


def test_a_text_longer_than_any_context_is_refused_before_it_is_tokenized(monkeypatch):
    from updraft.demo import DEMO_MODEL_DIR
    from updraft.tokenizer import Tokenizer

    calls = []
    encode = Tokenizer.encode
    monkeypatch.setattr(
        Tokenizer,
        "encode",
        lambda self, text, *special: calls.append(text) or encode(self, text, *special),
    )
    with running_server(enforce_eager=True) as url:  # the default 1 MiB body limit
        context = httpx.get(f"{url}/v1/models").json()["data"][0]["max_model_len"]
        bound = context * Tokenizer.from_dir(DEMO_MODEL_DIR).max_token_chars
        body = {"model": MODEL, "prompt": "a" * (bound + 1), "max_tokens": 1}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 400, response.text
        message = response.json()["error"]["message"]
        assert f"{bound + 1} characters are more than {context} tokens" in message
        assert calls == [], "the text was tokenized before it was refused"
        body["prompt"] = "a" * 100  # a text under the bound is tokenized as before
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
        assert len(calls) == 1
