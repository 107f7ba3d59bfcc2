"""Start-up benchmark: time to the first generated token on the demo model, cold and warm.

Every measurement is a fresh process, timed from its launch, as a user meets it:

* ``updraft generate``: until it reports its one token;
* ``LLM()`` then one generate of one token;
* ``updraft serve``: until ``/health`` answers, and until the first completion returns.

Cold means empty compile caches: a fresh user cache directory (``XDG_CACHE_HOME``, where
inductor's compiled runs are kept) and a fresh temporary folder (``TMPDIR``, where the C
kernels are built), with the page cache dropped first where this user may
(``/proc/sys/vm/drop_caches``; the report says when it could not). Warm is the same
process again over the caches the cold one filled.

Every process may keep the bytecode it compiles, as a user's Python does, whatever this
shell's ``PYTHONDONTWRITEBYTECODE`` says.

Then decode speed, in a warm process: after every bucket's compiled runs are swapped in
(the default start), against an engine that compiles every bucket before its first step
(``--no-graphs-in-background``, the start before graphs were made in the background).

``--timeline`` shows where a warm ``serve`` start goes instead (``--cold``: a cold one):
each line serve writes while it starts (the engine process spawned, the API process
loaded, the engine ready, uvicorn listening), then /health and the first completion, in
seconds from its launch.

    .venv/bin/python -m benchmarks.bench_startup              # the whole table
    .venv/bin/python -m benchmarks.bench_startup --smoke      # warm only, the user's caches
    .venv/bin/python -m benchmarks.bench_startup --timeline   # serve's start, line by line
    .venv/bin/python -m benchmarks.bench_startup --timeline --cold
    .venv/bin/python -m benchmarks.bench_startup --decode-model FILE.gguf [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO

import httpx

from benchmarks.common import free_port, markdown_table

PROMPT = "def fibonacci(n):"
ROOT = Path(__file__).resolve().parent.parent

# The LLM() run, in a process of its own: prints FIRST once its first token is back, then
# (with a token count) decode speed once its graphs are all in.
LLM_SCRIPT = f"""
import sys, time
from updraft import LLM, SamplingParams
tokens, background = int(sys.argv[1]), sys.argv[2] == "1"
llm = LLM(*sys.argv[3:4], graphs_in_background=background)
# a model of the caller's may have no tokenizer: token ids, then
prompt = list(range(1, 33)) if sys.argv[3:] else {PROMPT!r}
llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
print("FIRST", flush=True)
if tokens:
    llm.engine.graphs_ready(wait=True)
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    llm.generate([prompt], params)  # warm-up
    best = 0.0
    for _ in range(3):
        start = time.perf_counter()
        (out,) = llm.generate([prompt], params)
        if len(out.outputs[0].token_ids) != tokens:
            raise SystemExit(f"decode made {{len(out.outputs[0].token_ids)}} tokens: {{out.error}}")
        best = max(best, tokens / (time.perf_counter() - start))
    print("SPEED", best, llm.engine.stats().describe_steps(), flush=True)
"""


def drop_page_cache() -> bool:
    """Whether the page cache could be dropped (root only)."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def timed_lines(
    command: list[str], env: dict[str, str], marks: list[str], stderr: bool = False
) -> dict[str, str]:
    """Runs ``command``; the seconds from its launch to each line (of stdout, and of
    stderr with ``stderr``) starting with a mark, with the rest of that line."""
    start = time.perf_counter()
    process = subprocess.Popen(
        command,
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if stderr else subprocess.DEVNULL,
        text=True,
    )
    seen: dict[str, str] = {}
    for line in process.stdout:
        for mark in marks:
            if line.startswith(mark) and mark not in seen:
                seen[mark] = f"{time.perf_counter() - start:.2f} {line[len(mark) :].strip()}"
    if process.wait() != 0:
        raise RuntimeError(f"{' '.join(command)} exited with {process.returncode}")
    return seen


def time_generate(env: dict[str, str]) -> float:
    """Seconds from launch until ``generate`` reports its one token (its summary line
    follows the token at once); not its exit, which waits for the graph worker to stop
    after the bucket in hand."""
    command = [sys.executable, "-m", "updraft", "generate", "--prompt", PROMPT]
    seen = timed_lines([*command, "--max-tokens", "1"], env, ["[updraft] 1 tokens"], stderr=True)
    return float(seen["[updraft] 1 tokens"].split()[0])


def time_llm(env: dict[str, str]) -> float:
    seen = timed_lines([sys.executable, "-c", LLM_SCRIPT, "0", "1"], env, ["FIRST"])
    return float(seen["FIRST"].split()[0])


def time_serve(
    env: dict[str, str], timeline: list[tuple[float, str]] | None = None
) -> tuple[float, float]:
    """Seconds until /health answers, and until the first completion has returned; with
    ``timeline``, each line serve writes to stderr meanwhile, with its second."""
    port = free_port()
    command = [sys.executable, "-m", "updraft", "serve", "--port", str(port)]
    start = time.perf_counter()
    process = subprocess.Popen(
        command,
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL if timeline is None else subprocess.PIPE,
        text=True,
    )
    if timeline is not None:
        reader = threading.Thread(target=_read_lines, args=(process.stderr, start, timeline))
        reader.start()
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"updraft serve exited with {process.returncode}")
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        health = time.perf_counter() - start
        body = {"model": "updraft-demo", "prompt": PROMPT, "max_tokens": 1, "temperature": 0}
        httpx.post(f"{base}/v1/completions", json=body, timeout=600).raise_for_status()
        completion = time.perf_counter() - start
    finally:
        process.terminate()
        process.wait(30)
    if timeline is not None:
        reader.join()
        timeline += [(health, "/health answers 200"), (completion, "the first completion is back")]
        timeline.sort()
    return health, completion


def _read_lines(stream: IO[str], start: float, lines: list[tuple[float, str]]) -> None:
    for line in stream:
        lines.append((time.perf_counter() - start, line.rstrip()))


def serve_timeline(env: dict[str, str], cold: bool = False) -> str:
    """A warm ``serve`` start, line by line (a first start fills the caches); ``cold``:
    the first start, over the caches ``env`` names."""
    if not cold:
        time_serve(env)
    timeline: list[tuple[float, str]] = []
    time_serve(env, timeline)
    shown = [(seconds, line) for seconds, line in timeline if "draining" not in line]
    end = next(i for i, (_, line) in enumerate(shown) if line.startswith("the first completion"))
    return markdown_table(
        f"A {'cold' if cold else 'warm'} `updraft serve` start, seconds from launch",
        ["seconds", "what"],
        [[f"{seconds:.2f}", line[:110].replace("|", "/")] for seconds, line in shown[: end + 1]],
    )


def decode_speed(env: dict[str, str], tokens: int, background: bool, model: str = "") -> str:
    command = [sys.executable, "-c", LLM_SCRIPT, str(tokens), "1" if background else "0"]
    command += [model] if model else []
    speed, *steps = timed_lines(command, env, ["SPEED"])["SPEED"].split()[1:]
    return f"{float(speed):.1f} tok/s ({' '.join(steps)})"


def swap_against_compiled_first(env: dict[str, str], tokens: int, model: str, rounds: int) -> str:
    """Decode on ``model`` after the background swap against compiled-first, one process
    each, the two alternated round by round (the demo model's steps are too short to
    tell them apart)."""
    rows = []
    for round_ in range(rounds):
        order = (True, False) if round_ % 2 == 0 else (False, True)
        speeds = {background: decode_speed(env, tokens, background, model) for background in order}
        rows.append([str(round_ + 1), speeds[True], speeds[False]])
    title = f"Decode on {Path(model).name}, {tokens} tokens at batch 1, best of 3 per process"
    header = ["round", "made in the background, all swapped in", "all compiled first"]
    return markdown_table(title, header, rows)


def first_tokens(env: dict[str, str]) -> list[str]:
    health, completion = time_serve(env)
    return [
        f"{time_generate(env):.2f}",
        f"{time_llm(env):.2f}",
        f"{health:.2f}",
        f"{completion:.2f}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="warm only, over the user's own compile cache, 16 tokens of decode",
    )
    parser.add_argument("--tokens", type=int, default=128, help="tokens per decode-speed run")
    parser.add_argument(
        "--timeline",
        action="store_true",
        help="instead, a warm serve start line by line, over the user's own caches",
    )
    parser.add_argument(
        "--cold",
        action="store_true",
        help="with --timeline: a cold start (empty caches, the page cache dropped)",
    )
    parser.add_argument(
        "--decode-model",
        help="instead, decode after the swap against compiled-first on this model, alternated",
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds of --decode-model")
    args = parser.parse_args()
    tokens = 16 if args.smoke else args.tokens
    env = dict(os.environ)
    # A user's Python keeps the bytecode it compiles (pip writes it at install): without
    # it, every start compiles updraft's modules from source again, about 0.2 s here.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    for name in ("TORCHINDUCTOR_CACHE_DIR", "UPDRAFT_GRAPHS_IN_BACKGROUND"):
        env.pop(name, None)
    if args.timeline:
        with tempfile.TemporaryDirectory(prefix="updraft-startup-") as work:
            if args.cold:
                env.update(XDG_CACHE_HOME=f"{work}/cache", TMPDIR=work)
                if not drop_page_cache():
                    print("the page cache could NOT be dropped (not root)")
            print(serve_timeline(env, args.cold))
        return
    if args.decode_model:
        decode_speed(env, 1, True, args.decode_model)  # fills the user's compile cache
        print(swap_against_compiled_first(env, tokens, args.decode_model, args.rounds))
        return
    work = Path(tempfile.mkdtemp(prefix="updraft-startup-"))
    if not args.smoke:
        env.update(XDG_CACHE_HOME=str(work / "cache"), TMPDIR=str(work / "tmp"))
    (work / "tmp").mkdir()
    rows, notes = [], []
    try:
        if not args.smoke:
            dropped = drop_page_cache()
            notes.append(
                "page cache dropped before the cold runs"
                if dropped
                else "the page cache could NOT be dropped (not root): cold runs read warm files"
            )
            # Each cold run starts from empty caches of its own.
            cold: list[float] = []
            for measure in (time_generate, time_llm, time_serve):
                for folder in ("cache", "tmp"):
                    shutil.rmtree(work / folder, ignore_errors=True)
                (work / "tmp").mkdir()
                drop_page_cache()
                result = measure(env)
                cold += result if isinstance(result, tuple) else [result]
            rows.append(["cold", *(f"{seconds:.2f}" for seconds in cold)])
        decode_speed(env, tokens, background=True)  # fills the caches: the runs after are warm
        rows.append(["warm", *first_tokens(env)])
        after_swap = decode_speed(env, tokens, background=True)
        compiled_first = decode_speed(env, tokens, background=False)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        markdown_table(
            "Start-up on the demo model, seconds from launch to the first token",
            ["start", "generate", "LLM()", "serve: /health", "serve: 1st completion"],
            rows,
        )
    )
    print(
        markdown_table(
            f"Decode, {tokens} tokens at batch 1, best of 3",
            ["graphs", "speed"],
            [
                ["made in the background, all swapped in", after_swap],
                ["all compiled before the first step", compiled_first],
            ],
        )
    )
    for note in notes:
        print(f"* {note}")


if __name__ == "__main__":
    main()
