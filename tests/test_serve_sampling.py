"""Every sampling field a vLLM or OpenAI client sends, through the openai SDK: the
server's tokens equal the offline engine's with the same SamplingParams, plain and
streamed; n and batched prompts come back as one choice each, in order."""

from __future__ import annotations

import logging
from collections import defaultdict

import httpx
import openai
import pytest

from updraft import LLM, SamplingParams
from updraft.chat_template import ChatTemplate
from updraft.demo import DEMO_MODEL_DIR
from updraft.tokenizer import Tokenizer

from .serving import MODEL, running_server, wait_for_idle

PROMPT = "The quick brown fox"
CONTEXT = 2048  # the demo's max_position_embeddings


@pytest.fixture(scope="module")
def server():
    with running_server() as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline():
    return LLM(capture_sizes=(1, 2, 4))


FIELDS = [
    ({"presence_penalty": 1.2, "frequency_penalty": 0.7}, {}),
    ({"logit_bias": {"12": -100, "14": 3}}, {}),
    ({}, {"repetition_penalty": 1.6}),
    ({}, {"min_tokens": 6, "stop_token_ids": [269]}),
    ({}, {"bad_words": ["the", " fox"]}),
    ({}, {"allowed_token_ids": [12, 14, 269, 294, 387]}),
]


def offline_params(native: dict, extra: dict, **rest) -> SamplingParams:
    fields = {**native, **extra}
    if "logit_bias" in fields:
        fields["logit_bias"] = {int(k): v for k, v in fields["logit_bias"].items()}
    return SamplingParams(**fields, **rest)


@pytest.mark.parametrize(("native", "extra"), FIELDS)
def test_each_field_gives_the_engine_s_tokens_plain_and_streamed(client, offline, native, extra):
    expected = offline.generate(
        PROMPT, offline_params(native, extra, temperature=0, max_tokens=12)
    )[0].outputs[0]
    plain = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, extra_body=extra, **native
    )
    assert plain.choices[0].text == expected.text
    streamed = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        stream=True,
        extra_body=extra,
        **native,
    )
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == expected.text


def test_chat_top_logprobs_plain_and_streamed(client, offline):
    messages = [{"role": "user", "content": "Say something"}]
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=5
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 5
        assert entry.top_logprobs[0].token == entry.token  # greedy: the likeliest
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)
        values = [alt.logprob for alt in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
    streamed = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=5,
        stream=True,
    )
    chunks = [c for c in streamed if c.choices and c.choices[0].logprobs]
    entries = [e for c in chunks for e in c.choices[0].logprobs.content]
    assert len(entries) == len(content)
    for got, want in zip(entries, content, strict=True):
        assert [a.token for a in got.top_logprobs] == [a.token for a in want.top_logprobs]
        assert [a.logprob for a in got.top_logprobs] == pytest.approx(
            [a.logprob for a in want.top_logprobs], abs=1e-4
        )


def test_completions_top_logprobs(client):
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3
    )
    logprobs = response.choices[0].logprobs
    assert len(logprobs.top_logprobs) == 5
    for token, logprob, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert len(top) <= 3 and top[token] == pytest.approx(logprob, abs=1e-5)


def test_n_and_batched_prompts_one_choice_each_in_order(client, offline):
    prompts = [PROMPT, "Once upon a time"]
    response = client.completions.create(
        model=MODEL, prompt=prompts, n=2, max_tokens=8, temperature=0
    )
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    for choice in response.choices:
        expected = offline.generate(
            prompts[choice.index // 2], SamplingParams(temperature=0, max_tokens=8)
        )
        assert choice.text == expected[0].outputs[0].text
    prompt_tokens = sum(len(offline.tokenizer.encode(p)) for p in prompts)
    assert response.usage.prompt_tokens == prompt_tokens  # each prompt once, whatever n
    assert response.usage.completion_tokens == 4 * 8
    sampled = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        n=3,
        max_tokens=10,
        seed=5,
        temperature=1.0,
    )
    texts = [c.message.content for c in sampled.choices]
    assert [c.index for c in sampled.choices] == [0, 1, 2] and len(set(texts)) > 1
    streamed = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        n=3,
        max_tokens=10,
        seed=5,
        temperature=1.0,
        stream=True,
    )
    pieces = defaultdict(str)
    finished = set()
    for chunk in streamed:
        for choice in chunk.choices:
            pieces[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert [pieces[i] for i in range(3)] == texts and finished == {0, 1, 2}


def test_echo_and_stop_strings_and_special_tokens(client, offline):
    echoed = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, echo=True
    )
    plain = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6))[0].outputs[0]
    assert echoed.choices[0].text == PROMPT + plain.text
    stop = plain.text[2:5]
    kept = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        stop=[stop],
        extra_body={"include_stop_str_in_output": True},
    )
    assert kept.choices[0].text.endswith(stop) and kept.choices[0].finish_reason == "stop"
    eos = offline.engine.model_config.eos_token_ids[0]
    # The EOS that ends a reply adds no text, as vLLM's does, unless the stop is asked
    # for in the output; then it is spelled, being a special token kept.
    for include, text in ((False, ""), (True, offline.tokenizer.decode([eos], False))):
        ended = client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=1,
            extra_body={
                "allowed_token_ids": [eos],
                "skip_special_tokens": False,
                "include_stop_str_in_output": include,
            },
        )
        assert ended.choices[0].text == text and ended.choices[0].finish_reason == "stop"


def test_usage_in_every_chunk_with_continuous_usage_stats(client):
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    counts = [c.usage.completion_tokens for c in chunks]
    assert all(c.usage is not None for c in chunks)
    assert counts == sorted(counts) and counts[-1] == 5


def test_truncated_prompts_and_template_options(client, offline):
    long = " ".join(["word"] * 200)
    truncated = client.completions.create(
        model=MODEL, prompt=long, max_tokens=2, extra_body={"truncate_prompt_tokens": 16}
    )
    assert truncated.usage.prompt_tokens == 16
    messages = [
        {"role": "user", "content": "Name a colour"},
        {"role": "assistant", "content": "My favourite colour is"},
    ]
    template = ChatTemplate.from_dir(DEMO_MODEL_DIR)
    text = template.render(messages, False, continue_final_message=True)
    assert text.endswith("My favourite colour is")
    expected = offline.generate(text, SamplingParams(temperature=0, max_tokens=6))[0]
    continued = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=6,
        temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    assert continued.choices[0].message.content == expected.outputs[0].text
    offline_reply = offline.chat(
        messages,
        SamplingParams(temperature=0, max_tokens=6),
        add_generation_prompt=False,
        continue_final_message=True,
    )
    assert offline_reply[0].outputs[0].text == expected.outputs[0].text
    with pytest.raises(openai.BadRequestError, match="continue_final_message"):
        client.chat.completions.create(
            model=MODEL, messages=messages, extra_body={"continue_final_message": True}
        )


def test_max_tokens_past_the_context_is_a_400_naming_both_numbers(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=CONTEXT)
    message = error.value.body["message"]
    num_prompt = len(Tokenizer.from_dir(DEMO_MODEL_DIR).encode(PROMPT))
    assert f"prompt's {num_prompt} tokens plus max_tokens={CONTEXT}" in message
    assert f"context length of {CONTEXT} tokens" in message
    with pytest.raises(openai.BadRequestError, match="max_completion_tokens"):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_completion_tokens=0
        )
    # Without a max_tokens (16 by default) the reply gets what room is left.
    reply = client.completions.create(
        model=MODEL, prompt=[10] * (CONTEXT - 5), temperature=0, extra_body={"ignore_eos": True}
    )
    assert reply.usage.completion_tokens == 5 and reply.choices[0].finish_reason == "length"


def test_models_by_id_content_types_and_unknown_fields(client, server, caplog):
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    response = httpx.post(
        f"{server}/v1/completions",
        content=b"model=x&prompt=y",
        headers={"content-type": "application/x-www-form-urlencoded"},
    )
    assert response.status_code == 415
    assert "application/json" in response.json()["error"]["message"]
    with caplog.at_level(logging.WARNING, logger="updraft.serve"):
        for _ in range(3):
            client.completions.create(
                model=MODEL, prompt="x", max_tokens=1, extra_body={"frobnicate_level": 3}
            )
    logged = [r for r in caplog.records if "frobnicate_level" in r.getMessage()]
    assert len(logged) == 1


def test_a_bad_prompt_in_a_batch_ends_the_ones_started(client, server):
    with pytest.raises(openai.BadRequestError, match="prompt"):
        client.completions.create(
            model=MODEL, prompt=[PROMPT, "", PROMPT], max_tokens=400, temperature=0
        )
    wait_for_idle(server)  # the first prompt's request was aborted, its blocks freed
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=2).choices


def test_prompt_logprobs_and_echoed_logprobs(client, server, offline):
    expected = offline.generate(PROMPT, SamplingParams(max_tokens=3, prompt_logprobs=2))[0]
    ids = expected.prompt_token_ids
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "prompt_logprobs": 2}
    choice = httpx.post(f"{server}/v1/completions", json=body).json()["choices"][0]
    scored = choice["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(ids)
    for entry, want, token in zip(scored[1:], expected.prompt_logprobs[1:], ids[1:], strict=True):
        assert entry[str(token)]["logprob"] == pytest.approx(want[token], abs=1e-4)
        assert len(entry) <= 3
    echoed = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=2
    )
    logprobs = echoed.choices[0].logprobs
    assert len(logprobs.tokens) == len(ids) + 3
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.token_logprobs[1] == pytest.approx(
        expected.prompt_logprobs[1][ids[1]], abs=1e-4
    )
    assert "".join(logprobs.tokens) == echoed.choices[0].text
    assert logprobs.text_offset[len(ids)] == len(PROMPT)
    streamed = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=2, stream=True
    )
    tokens = [t for chunk in streamed for t in chunk.choices[0].logprobs.tokens]
    assert tokens == logprobs.tokens
    chat = httpx.post(
        f"{server}/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 2,
            "prompt_logprobs": 0,
        },
    ).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) > 2
