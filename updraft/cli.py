"""``updraft`` command line: ``updraft generate --prompt "..."``, ``updraft serve``,
``updraft doctor``."""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
import typing
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path

# Only leaves at import time: `updraft --help` must not wait for torch.
from updraft import __version__
from updraft.config import EngineConfig
from updraft.demo import DEMO_DRAFT_DIR, DEMO_EAGLE_DIR, DEMO_MODEL_DIR
from updraft.sampling_params import SamplingParams


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except where there is none or the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help_text = action.help or ""
        default = action.default
        unset = default is None or default is False or default == [] or default is argparse.SUPPRESS
        if unset or "default" in help_text:
            return action.help
        return f"{help_text} (default: %(default)s)".strip()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="updraft",
        description="updraft: LLM inference with a paged KV cache and continuous batching.",
    )
    parser.add_argument("--version", action="version", version=f"updraft {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_generate_parser(commands)
    add_serve_parser(commands)
    add_doctor_parser(commands)
    return parser


def add_generate_parser(commands: argparse._SubParsersAction) -> None:
    generate = commands.add_parser(
        "generate",
        help="generate a completion for a prompt, streaming it to stdout",
        description=(
            "Generate a completion and stream it to stdout; a one-line summary (tokens, "
            "tokens/s, time to first token) goes to stderr. Without --model the shipped "
            "demo model (a small Llama trained on Python's standard library) is used. "
            "One request runs, so only the batch-1 step is captured unless "
            "--capture-sizes says otherwise."
        ),
        formatter_class=HelpFormatter,
    )
    source = generate.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="the prompt text; - reads it from standard input")
    source.add_argument("--prompt-file", type=Path, help="read the prompt from this file")
    add_engine_arguments(generate)
    # One request runs at a time here: capturing (and compiling) the batch-1 step is
    # enough, and keeps the first start on a machine short. Its one prefill runs eagerly:
    # compiling mixed buckets for it took the demo's first start from 12 to 43 s.
    generate.set_defaults(capture_sizes=(1,), capture_tokens=())
    add_sampling_arguments(generate.add_argument_group("sampling"))


def add_sampling_arguments(sampling: argparse._ArgumentGroup) -> None:
    sampling.add_argument("--max-tokens", type=int, default=64)
    sampling.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0 is greedy, the CLI's default (SamplingParams and the server default to 1)",
    )
    sampling.add_argument("--top-k", type=int, default=0, help="0 turns it off")
    sampling.add_argument("--top-p", type=float, default=1.0)
    sampling.add_argument("--min-p", type=float, default=0.0)
    sampling.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="above 1 discourages any token of the prompt or output (transformers' rule)",
    )
    sampling.add_argument("--presence-penalty", type=float, default=0.0, help="-2 to 2")
    sampling.add_argument("--frequency-penalty", type=float, default=0.0, help="-2 to 2")
    sampling.add_argument(
        "--stop",
        action="append",
        default=[],
        type=unescape,
        help=r"stop string (repeatable); \n, \t, \r and \\ are read as escapes",
    )
    sampling.add_argument("--ignore-eos", action="store_true")


def add_doctor_parser(commands: argparse._SubParsersAction) -> None:
    doctor = commands.add_parser(
        "doctor",
        help="check that captured graph replay agrees with eager on this model",
        description=(
            "Run the same prompts eagerly and with captured decode steps in sanitize mode "
            "(each replay also run eagerly on a copy of the KV cache); report the largest "
            "differences and whether greedy outputs agree. Exits 1 when unhealthy."
        ),
        formatter_class=HelpFormatter,
    )
    doctor.add_argument(
        "--memory",
        action="store_true",
        help="instead, start the engine, run one request and report where its resident "
        "memory goes (weights mapped and copied, KV cache, graphs, imports, other) and "
        "the phase of the start its peak came in",
    )
    add_engine_arguments(doctor)


def add_serve_parser(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser(
        "serve",
        help="serve an OpenAI-compatible HTTP API",
        description=(
            "Serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics "
            "over HTTP. Binds 127.0.0.1 unless --host says otherwise."
        ),
        formatter_class=HelpFormatter,
    )
    add_http_arguments(serve.add_argument_group("server"))
    add_limit_arguments(serve.add_argument_group("limits"))
    add_engine_arguments(serve)


def add_http_arguments(http: argparse._ArgumentGroup) -> None:
    http.add_argument("--host", default="127.0.0.1", help="0.0.0.0 listens on every interface")
    http.add_argument("--port", type=int, default=8000)
    http.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients send (default: --model as given, or updraft-demo)",
    )
    http.add_argument(
        "--api-key",
        default=None,  # read from the environment later, so --help never prints a key
        help="require 'Authorization: Bearer KEY' on /v1 routes; falls back to $UPDRAFT_API_KEY",
    )
    http.add_argument(
        "--tool-call-parser",
        choices=["hermes", "llama3_json", "mistral", "deepseek_v3", "phi4_mini_json"],
        default=None,
        help="how tool calls are read from a reply with tool_choice auto: hermes "
        "(<tool_call> blocks, Qwen2.5/Qwen3), llama3_json (Llama 3.x's JSON calls), "
        "mistral ([TOOL_CALLS]), deepseek_v3 (<｜tool▁calls▁begin｜>, V3/R1/V3.1) or "
        "phi4_mini_json (functools[...]); default: the one the model's chat template writes",
    )
    http.add_argument(
        "--reasoning-parser",
        default=None,
        help="split <think>...</think> out of chat replies into reasoning_content (a "
        "grammar then constrains only the answer after it): qwen3, deepseek_r1 or "
        "deepseek_v3 (as vLLM names them); default: on where the model's chat template "
        "shows thinking, none to turn it off",
    )
    http.add_argument(
        "--structured-outputs-in-reasoning",
        action="store_true",
        help="a grammar (response_format, a required tool call) constrains the reasoning "
        "too, not only the answer after it",
    )
    http.add_argument(
        "--drain-timeout",
        type=float,
        default=60.0,
        help="seconds SIGTERM waits for running requests before aborting them",
    )
    http.add_argument(
        "--api-server-count",
        type=int,
        default=1,
        help="API processes in front of the one engine process: each parses, tokenizes "
        "and decodes for its share of the connections (more help with many clients)",
    )


def add_limit_arguments(limits: argparse._ArgumentGroup) -> None:
    """What one client may ask of the server, and how long it may take."""
    limits.add_argument(
        "--max-request-bytes", type=int, default=1 << 20, help="larger bodies get 413"
    )
    limits.add_argument(
        "--max-tokens-limit",
        type=int,
        default=None,
        help="largest max_tokens a request may ask for (default: the context length)",
    )
    limits.add_argument(
        "--max-waiting",
        type=int,
        default=256,
        help="with this many requests queued, new ones get 503 with Retry-After",
    )
    limits.add_argument(
        "--max-connections",
        type=int,
        default=1024,
        help="open connections at once; past it, the one that has waited longest without "
        "sending a whole request is closed (capped by the open-file limit)",
    )
    limits.add_argument(
        "--request-timeout",
        type=float,
        default=30.0,
        help="seconds a client has to send a whole request (headers and body)",
    )


# What the help of a flag says beyond its field's help.
HELP_SUFFIX = {
    "model": f" (default: the demo model, {DEMO_MODEL_DIR})",
    "speculative_model": f"; the demo's draft is {DEMO_DRAFT_DIR}, its EAGLE head "
    f"{DEMO_EAGLE_DIR} (the default for eagle)",
}


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per ``EngineConfig`` field, its default, type and help taken from there."""
    engine = parser.add_argument_group("engine")
    hints = typing.get_type_hints(EngineConfig)
    for config_field in fields(EngineConfig):
        name = config_field.name
        options = dict(config_field.metadata)
        options["help"] += HELP_SUFFIX.get(name, "")
        if name == "model":  # required by EngineConfig; the CLI falls back to the demo
            engine.add_argument("--model", default=None, **options)
            continue
        flag = "--" + name.replace("_", "-")
        engine.add_argument(flag, default=config_field.default, **options, **_parse_as(hints[name]))


def _parse_as(kind: object) -> dict:
    """argparse options that read a value of type ``kind``."""
    if kind is bool or kind == bool | None:
        return {"action": argparse.BooleanOptionalAction}
    if kind in (tuple[int, ...], tuple[int, ...] | None):
        return {"type": int_list, "metavar": "N,N,..."}
    args = [arg for arg in typing.get_args(kind) if arg is not type(None)]
    return {"type": args[0] if args else kind}


def int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(size) for size in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The ``EngineConfig`` fields from parsed flags (all but ``model``)."""
    return {f.name: getattr(args, f.name) for f in fields(EngineConfig) if f.name != "model"}


ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


def unescape(text: str) -> str:
    """``--stop "\\n"`` arrives as a backslash and an n (the shell does not turn it into
    a newline): read the common escapes, so that it means what it looks like."""
    return re.sub(r"\\([ntr\\])", lambda match: ESCAPES[match.group(1)], text)


def read_prompt(args: argparse.Namespace) -> str:
    if args.prompt_file is not None:
        return args.prompt_file.read_text()
    return sys.stdin.read() if args.prompt == "-" else args.prompt


def load(model: str | None, engine_args: dict):
    """An ``LLM``, saying on stderr what it is doing meanwhile: loading weights and
    capturing graphs take seconds."""
    from updraft.c_builds import kernels_for, prebuild

    prebuild(kernels_for(model or DEMO_MODEL_DIR))  # the compiler runs beside torch's import
    from updraft.config import EngineConfig
    from updraft.engine.llm import LLM

    config = EngineConfig(model=str(model or DEMO_MODEL_DIR), **engine_args)
    print(f"[updraft] {config.start_up_steps()} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    llm = LLM(model, **engine_args)
    print(f"[updraft] ready in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    return llm


def run_generate(args: argparse.Namespace) -> int:
    prompt = read_prompt(args)

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
    )
    llm = load(args.model, engine_kwargs(args))
    room = llm.engine.max_model_len - _num_prompt_tokens(llm, prompt)
    if 0 < room < args.max_tokens:
        print(
            f"[updraft] --max-tokens {args.max_tokens} does not fit after the prompt: at most "
            f"{room} tokens will be generated (context {llm.engine.max_model_len} tokens)",
            file=sys.stderr,
        )
    start = time.perf_counter()
    final = None
    for output in llm.generate_stream(prompt, params):
        sys.stdout.write(output.outputs[0].delta_text)
        sys.stdout.flush()
        final = output
    elapsed = time.perf_counter() - start
    sys.stdout.write("\n")
    if final is None or final.error:
        print(f"error: {final.error if final else 'no output'}", file=sys.stderr)
        return 1
    metrics = final.metrics
    ttft = metrics.time_to_first_token or 0.0
    tokens = metrics.num_output_tokens
    decode_time = elapsed - ttft
    decode_rate = (tokens - 1) / decode_time if tokens > 1 and decode_time > 0 else 0.0
    print(
        f"[updraft] {tokens} tokens in {elapsed:.2f} s ({tokens / elapsed:.1f} tokens/s, "
        f"decode {decode_rate:.1f} tokens/s), time to first token {ttft * 1000:.0f} ms, "
        f"prompt {metrics.num_prompt_tokens} tokens, finish: {final.outputs[0].finish_reason}",
        file=sys.stderr,
    )
    stats = llm.engine.stats()
    print(f"[updraft] steps: {stats.describe_steps()}", file=sys.stderr)
    if stats.speculative is not None:
        seconds = stats.phase_seconds
        print(
            f"[updraft] speculative: {stats.speculative.summary()}, draft "
            f"{seconds['propose']:.2f} s, verify {seconds['forward'] + seconds['sample']:.2f} s",
            file=sys.stderr,
        )
    if stats.draft_steps is not None:
        print(f"[updraft] draft steps: {stats.describe_draft_steps()}", file=sys.stderr)
    return 0


def _num_prompt_tokens(llm, prompt: str) -> int:
    tokenizer = llm.tokenizer
    return 0 if tokenizer is None else len(tokenizer.encode(prompt))


def run_serve(args: argparse.Namespace) -> int:
    # Nothing heavy before the engine process is spawned (serve/launch.py).
    from updraft.serve.launch import default_model_name, serve
    from updraft.serve.settings import ServeSettings

    api_key, source = args.api_key, "--api-key"
    if api_key is None:
        api_key, source = os.environ.get("UPDRAFT_API_KEY"), "UPDRAFT_API_KEY"
    if api_key is not None and not api_key.strip():
        # `--api-key "$KEY"` with KEY unset must not quietly start an open server.
        raise ValueError(
            f"the API key from {source} is empty; give a key, or leave out both --api-key "
            "and UPDRAFT_API_KEY to serve without one"
        )
    settings = ServeSettings(
        model_name=args.served_model_name or default_model_name(args.model),
        api_key=api_key,
        max_request_bytes=args.max_request_bytes,
        max_tokens_limit=args.max_tokens_limit,
        max_waiting=args.max_waiting,
        drain_timeout=args.drain_timeout,
        max_connections=args.max_connections,
        request_timeout=args.request_timeout,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        structured_outputs_in_reasoning=args.structured_outputs_in_reasoning,
    )
    return serve(
        args.model, engine_kwargs(args), settings, args.host, args.port, args.api_server_count
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return run_generate(args)
        if args.command == "serve":
            return run_serve(args)
        if args.command == "doctor" and args.memory:
            from updraft.resident import ImportBaseline

            baseline = ImportBaseline.measure()  # before anything else imports torch
            from updraft.memory_doctor import memory_doctor

            return 0 if memory_doctor(args.model, engine_kwargs(args), baseline) else 1
        if args.command == "doctor":
            from updraft.doctor import doctor

            return 0 if doctor(args.model, engine_kwargs(args)) else 1
    except (ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\n[updraft] interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
