"""``updraft`` command line: ``updraft generate --prompt "..."``, ``updraft serve``,
``updraft doctor``."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

from updraft.config import DTYPES, EngineConfig
from updraft.doctor import doctor
from updraft.engine.llm import DEMO_DRAFT_DIR, DEMO_MODEL_DIR, LLM
from updraft.sampling import SamplingParams


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
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    generate = commands.add_parser(
        "generate",
        help="generate a completion for a prompt, streaming it to stdout",
        description=(
            "Generate a completion and stream it to stdout; a one-line summary (tokens, "
            "tokens/s, time to first token) goes to stderr. Without --model the shipped "
            "demo model (a small Llama trained on Python's standard library) is used."
        ),
        formatter_class=HelpFormatter,
    )
    generate.add_argument("--prompt", required=True, help="the prompt text")
    add_engine_arguments(generate)
    sampling = generate.add_argument_group("sampling")
    sampling.add_argument("--max-tokens", type=int, default=64)
    sampling.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    sampling.add_argument("--top-k", type=int, default=0, help="0 turns it off")
    sampling.add_argument("--top-p", type=float, default=1.0)
    sampling.add_argument("--min-p", type=float, default=0.0)
    sampling.add_argument("--seed", type=int, default=None)
    sampling.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    sampling.add_argument("--ignore-eos", action="store_true")
    add_serve_parser(commands)
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
    add_engine_arguments(doctor)
    return parser


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
    http = serve.add_argument_group("server")
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
        "--max-request-bytes", type=int, default=1 << 20, help="larger bodies get 413"
    )
    http.add_argument(
        "--max-tokens-limit",
        type=int,
        default=None,
        help="largest max_tokens a request may ask for (default: the context length)",
    )
    http.add_argument(
        "--max-waiting",
        type=int,
        default=256,
        help="with this many requests queued, new ones get 503 with Retry-After",
    )
    http.add_argument(
        "--drain-timeout",
        type=float,
        default=60.0,
        help="seconds SIGTERM waits for running requests before aborting them",
    )
    add_engine_arguments(serve)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    engine = parser.add_argument_group("engine")
    engine.add_argument(
        "--model",
        default=None,
        help=f"local Hugging Face checkpoint directory (default: the demo model, {DEMO_MODEL_DIR})",
    )
    engine.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", *DTYPES],
        help="compute dtype; auto is float32 on the CPU and the checkpoint's dtype on a GPU",
    )
    engine.add_argument("--device", default="cpu", help="cpu or cuda")
    engine.add_argument("--kv-cache-memory-gib", type=float, default=1.0)
    engine.add_argument("--max-model-len", type=int, default=None)
    engine.add_argument("--max-num-seqs", type=int, default=64)
    engine.add_argument("--max-num-batched-tokens", type=int, default=1024)
    engine.add_argument("--block-size", type=int, default=16)
    engine.add_argument("--no-prefix-caching", action="store_true")
    engine.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run every step eagerly; --no-enforce-eager replays captured decode steps "
        "(default: graphs on CUDA, eager on the CPU)",
    )
    engine.add_argument(
        "--capture-sizes",
        type=capture_sizes,
        default=EngineConfig.capture_sizes,
        help="decode batch sizes to capture, comma-separated",
    )

    spec = parser.add_argument_group("speculative decoding")
    spec.add_argument(
        "--speculative-model",
        default=None,
        help="draft model checkpoint directory (same tokenizer as the target); the demo "
        f"draft is {DEMO_DRAFT_DIR}",
    )
    spec.add_argument(
        "--speculative-method",
        choices=["draft", "ngram"],
        default=None,
        help="ngram: prompt lookup, no model; draft: implied by --speculative-model",
    )
    spec.add_argument("--num-speculative-tokens", type=int, default=3, help="drafts per step")
    spec.add_argument(
        "--speculative-enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the draft model's steps eagerly (default: as the target)",
    )


def capture_sizes(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(size) for size in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"capture sizes must be comma-separated integers, got {text!r}"
        ) from None


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        dtype=args.dtype,
        device=args.device,
        kv_cache_memory_gib=args.kv_cache_memory_gib,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        enable_prefix_caching=not args.no_prefix_caching,
        enforce_eager=args.enforce_eager,
        capture_sizes=args.capture_sizes,
        speculative_model=args.speculative_model,
        speculative_method=args.speculative_method,
        num_speculative_tokens=args.num_speculative_tokens,
        speculative_enforce_eager=args.speculative_enforce_eager,
    )


def run_generate(args: argparse.Namespace) -> int:
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    llm = LLM(args.model, **engine_kwargs(args))
    start = time.perf_counter()
    final = None
    for output in llm.generate_stream(args.prompt, params):
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
    print(f"[updraft] steps: {llm.engine.runner.describe_steps()}", file=sys.stderr)
    speculator = llm.engine.speculator
    if speculator is not None:
        print(f"[updraft] speculative: {speculator.metrics.summary()}", file=sys.stderr)
        draft_runner = getattr(speculator.proposer, "runner", None)
        if draft_runner is not None:
            print(f"[updraft] draft steps: {draft_runner.describe_steps()}", file=sys.stderr)
    return 0


def run_serve(args: argparse.Namespace) -> int:
    from updraft.serve.server import default_model_name, serve
    from updraft.serve.serving import ServeSettings

    settings = ServeSettings(
        model_name=args.served_model_name or default_model_name(args.model),
        api_key=args.api_key or os.environ.get("UPDRAFT_API_KEY") or None,
        max_request_bytes=args.max_request_bytes,
        max_tokens_limit=args.max_tokens_limit,
        max_waiting=args.max_waiting,
        drain_timeout=args.drain_timeout,
    )
    return serve(args.model, engine_kwargs(args), settings, args.host, args.port)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return run_generate(args)
        if args.command == "serve":
            return run_serve(args)
        if args.command == "doctor":
            return 0 if doctor(args.model, engine_kwargs(args)) else 1
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
