"""What a new user meets first: fast help, messages instead of tracebacks, prompts from
anywhere, Hub ids from the local cache, and chat from Python."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import updraft
from tests.helpers import greedy
from updraft import LLM
from updraft.chat_template import ChatTemplate
from updraft.cli import main
from updraft.demo import DEMO_MODEL_DIR


def test_help_is_quick_because_it_loads_no_torch():
    code = (
        "import sys, updraft.cli\n"
        "text = updraft.cli.build_parser()._subparsers._group_actions[0].choices['generate']"
        ".format_help()\n"
        "print('torch' in sys.modules, '(default: 16)' in text)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.split() == ["False", "True"]


def test_a_stop_string_typed_as_backslash_n_means_a_newline(capsys):
    prompt = "def add(a, b):\n"
    reference = LLM().generate(prompt, greedy(40, ignore_eos=False, stop=["\n"]))
    assert main(["generate", "--prompt", prompt, "--max-tokens", "40", "--stop", "\\n"]) == 0
    out = capsys.readouterr().out
    assert out == reference[0].outputs[0].text + "\n" and "\n" not in out[:-1]


def test_prompts_come_from_a_file_or_standard_input(capsys, tmp_path, monkeypatch):
    import io

    argv = ["generate", "--max-tokens", "8"]
    assert main([*argv, "--prompt", "import os"]) == 0
    expected = capsys.readouterr().out
    (tmp_path / "prompt.txt").write_text("import os")
    assert main([*argv, "--prompt-file", str(tmp_path / "prompt.txt")]) == 0
    assert capsys.readouterr().out == expected
    monkeypatch.setattr(sys, "stdin", io.StringIO("import os"))
    assert main([*argv, "--prompt", "-"]) == 0
    assert capsys.readouterr().out == expected


def broken_config(tmp_path, key: str):
    model = tmp_path / "model"
    shutil.copytree(DEMO_MODEL_DIR, model)
    config = json.loads((model / "config.json").read_text())
    del config[key]
    (model / "config.json").write_text(json.dumps(config))
    return model


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--kv-cache-memory-gib", "1000000"], "cannot allocate a KV cache"),
        (["--max-model-len", "100000"], "above the 2048 positions"),
        (["--device", "gpu"], "device must be 'cpu', 'cuda' or 'cuda:N'"),
        (["--model", "acme/not-downloaded"], "never downloads"),
    ],
)
def test_bad_settings_get_a_message_not_a_traceback(capsys, flags, message):
    assert main(["generate", "--prompt", "x", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the message on a machine without CUDA"
)
def test_cuda_without_a_gpu_is_a_message(capsys):
    assert main(["generate", "--prompt", "x", "--device", "cuda"]) == 2
    assert "sees no CUDA device" in capsys.readouterr().err


def test_a_config_missing_a_key_names_it(capsys, tmp_path):
    model = broken_config(tmp_path, "num_attention_heads")
    assert main(["generate", "--prompt", "x", "--model", str(model)]) == 2
    assert "config.json lacks 'num_attention_heads'" in capsys.readouterr().err


def test_loading_says_what_it_is_doing(capsys):
    assert main(["generate", "--prompt", "x", "--max-tokens", "2", "--no-enforce-eager"]) == 0
    err = capsys.readouterr().err
    assert "[updraft] loading the model and capturing graphs ..." in err
    assert "[updraft] ready in" in err


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_ctrl_c_ends_quietly(command):
    argv = [sys.executable, "-m", "updraft", command]
    if command == "generate":
        argv += ["--prompt", "import os", "--max-tokens", "2000", "--ignore-eos"]
    else:
        argv += ["--port", "0"]
    process = subprocess.Popen(
        argv,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        # A suite started in the background inherits SIGINT ignored; Ctrl-C must reach it.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 60
    seen = ""
    ready = "[updraft] ready in" if command == "generate" else "Uvicorn running"
    while ready not in seen:
        line = process.stderr.readline()
        assert line or process.poll() is None, seen
        seen += line
        assert time.monotonic() < deadline, seen
    assert "[updraft] ready in" in seen  # serve says what it does before it listens
    time.sleep(0.5)
    process.send_signal(signal.SIGINT)
    rest = process.communicate(timeout=60)[1]
    assert "Traceback" not in seen + rest, seen + rest
    assert process.returncode == 130, seen + rest  # the shell's code for "ended by Ctrl-C"
    assert "[updraft] interrupted" in rest


def test_a_hub_id_resolves_to_a_snapshot_in_the_local_cache(tmp_path, monkeypatch):
    repo = tmp_path / "hub" / "models--acme--tiny"
    shutil.copytree(DEMO_MODEL_DIR, repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    params = greedy(6, ignore_eos=False)
    got = LLM("acme/tiny").generate("import os", params)[0].outputs[0].token_ids
    assert got == LLM().generate("import os", params)[0].outputs[0].token_ids
    with pytest.raises(FileNotFoundError, match=r"never downloads.*hf download acme/other"):
        LLM("acme/other")


def test_chat_renders_the_template_then_generates():
    llm = LLM()
    messages = [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "Sort."},
    ]
    params = greedy(12, ignore_eos=False)
    prompt = ChatTemplate.from_dir(DEMO_MODEL_DIR).render(messages)
    (reply,) = llm.chat(messages, params)
    assert reply.outputs[0].text == llm.generate(prompt, params)[0].outputs[0].text
    assert len(llm.chat([messages, messages[1:]], params)) == 2


def test_generate_says_when_max_tokens_does_not_fit(capsys):
    argv = ["generate", "--prompt", "import os", "--max-tokens", "100000", "--ignore-eos"]
    argv += ["--max-model-len", "64", "--repetition-penalty", "1.3"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "--max-tokens 100000 does not fit after the prompt" in err
    assert "context 64 tokens" in err and "finish: length" in err


def test_version_and_a_taken_port_found_before_loading(capsys):
    import socket

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"updraft {updraft.__version__}"
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        started = time.monotonic()
        result = subprocess.run(
            [sys.executable, "-m", "updraft", "serve", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        taken.close()
    assert result.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "loading the model" not in result.stderr
    assert time.monotonic() - started < 30
