"""Finish reasons, streaming and abort, on a tiny model with a byte-level tokenizer."""

from __future__ import annotations

import json

import pytest

from tests.helpers import greedy
from tests.probes import assert_idle
from updraft import LLM

PROMPT = "def main():"


@pytest.fixture(scope="module")
def llm(tiny_llama_with_tokenizer):
    return LLM(tiny_llama_with_tokenizer, num_kv_blocks=64, block_size=4)


def test_max_tokens_finishes_with_length(llm):
    completion = llm.generate(PROMPT, greedy(24))[0].outputs[0]
    assert len(completion.token_ids) == 24 and completion.finish_reason == "length"
    assert completion.text == llm.tokenizer.decode(completion.token_ids)


def test_stop_token_id_finishes_with_stop(llm):
    reference = llm.generate(PROMPT, greedy(24))[0].outputs[0].token_ids
    stop_token = reference[5]
    first = reference.index(stop_token)
    completion = llm.generate(PROMPT, greedy(24, stop_token_ids=[stop_token]))[0].outputs[0]
    assert completion.token_ids == reference[: first + 1]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop_token


def test_stop_string_cuts_the_text_before_it(llm):
    reference = llm.generate(PROMPT, greedy(24))[0].outputs[0].text
    stop = reference[6:9]
    completion = llm.generate(PROMPT, greedy(24, stop=[stop]))[0].outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert completion.text == reference[: reference.index(stop)]


def test_eos_finishes_unless_ignored(tmp_path, tiny_llama_with_tokenizer):
    reference = LLM(tiny_llama_with_tokenizer).generate(PROMPT, greedy(24))[0].outputs[0]
    eos = reference.token_ids[3]
    model_dir = tmp_path / "with_eos"
    model_dir.mkdir()
    for path in tiny_llama_with_tokenizer.iterdir():
        (model_dir / path.name).write_bytes(path.read_bytes())
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    llm = LLM(model_dir)
    stopped = llm.generate(PROMPT, greedy(24, ignore_eos=False))[0].outputs[0]
    first = reference.token_ids.index(eos)
    assert stopped.token_ids == reference.token_ids[: first + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason is None
    assert llm.generate(PROMPT, greedy(24))[0].outputs[0].token_ids == reference.token_ids


def test_stream_deltas_add_up_to_the_final_output(llm):
    final = llm.generate([PROMPT, "x = 1"], greedy(24, stop=["\n\n"]))
    texts, tokens, finished = {}, {}, {}
    for output in llm.generate_stream([PROMPT, "x = 1"], greedy(24, stop=["\n\n"])):
        texts[output.request_id] = texts.get(output.request_id, "") + output.outputs[0].delta_text
        tokens.setdefault(output.request_id, []).extend(output.outputs[0].delta_token_ids)
        assert output.request_id not in finished, "output after the request finished"
        if output.finished:
            finished[output.request_id] = output
    assert len(finished) == 2
    for output, request_id in zip(final, sorted(finished, key=int), strict=True):
        assert texts[request_id] == output.outputs[0].text
        assert tokens[request_id] == output.outputs[0].token_ids
        assert finished[request_id].outputs[0].text == output.outputs[0].text
    assert_idle(llm)


def test_abort_mid_stream_frees_blocks_and_others_go_on(llm):
    outputs = {}
    aborted_id = None
    for output in llm.generate_stream([PROMPT, "import os"], greedy(max_tokens=30)):
        outputs[output.request_id] = output
        if aborted_id is None and len(output.outputs[0].token_ids) == 5:
            aborted_id = output.request_id
            assert llm.abort(aborted_id)
            assert not llm.abort(aborted_id), "a second abort finds nothing"
    aborted = outputs.pop(aborted_id)
    (survivor,) = outputs.values()
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    assert len(aborted.outputs[0].token_ids) == 5
    assert survivor.outputs[0].finish_reason == "length"
    assert len(survivor.outputs[0].token_ids) == 30
    assert_idle(llm)


def test_outputs_carry_timings(llm):
    output = llm.generate(PROMPT, greedy(max_tokens=4))[0]
    metrics = output.metrics
    assert metrics.num_prompt_tokens == len(llm.tokenizer.encode(PROMPT))
    assert metrics.num_output_tokens == 4
    assert 0 < metrics.time_to_first_token <= metrics.latency


def test_closing_a_stream_early_aborts_its_requests(llm):
    stream = llm.generate_stream([PROMPT, "import os"], greedy(max_tokens=30))
    next(stream)
    stream.close()
    assert_idle(llm)
    assert len(llm.generate(PROMPT, greedy(max_tokens=3))[0].outputs[0].token_ids) == 3


def test_aborting_waiting_and_running_requests(tiny_llama_with_tokenizer):
    llm = LLM(tiny_llama_with_tokenizer, num_kv_blocks=64, block_size=4, max_num_seqs=1)
    ids = [llm.engine.add_request(p, greedy(max_tokens=4)) for p in ("a", "b", "c")]
    llm.engine.step()  # "a" runs, "b" and "c" wait
    assert llm.abort(ids[2]) and llm.abort(ids[0])
    finals = {}
    while llm.engine.has_unfinished:
        finals.update({o.request_id: o for o in llm.engine.step() if o.finished})
    assert [finals[i].outputs[0].finish_reason for i in ids] == ["abort", "length", "abort"]
    assert len(finals[ids[1]].outputs[0].token_ids) == 4
    assert_idle(llm)
