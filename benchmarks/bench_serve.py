"""HTTP serving benchmark: ``updraft serve`` on the demo model, driven by an async client.

The server runs as a subprocess on a free loopback port, as a user would run it. One
client process sends the same requests at several Poisson arrival rates, streaming, and
once more all at once without streaming. It measures, from the client's side:

* time to first token (TTFT): from sending the request to the first text chunk;
* inter-token latency (ITL): between consecutive text chunks of one stream;
* end-to-end latency, request throughput and output tokens/s over the whole run.

    .venv/bin/python benchmarks/bench_serve.py [--quick]

With ``--hostile`` it measures instead what clients that send huge text prompts cost a
stream: a canary stream's tokens/s alone, then while six clients loop over prompts of
86,000 characters (under the server's character bound, over the context, so each is
tokenized and answered 400).

    .venv/bin/python -m benchmarks.bench_serve --hostile [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import httpx

from benchmarks.common import free_port, markdown_table

MODEL = "updraft-demo"
PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):",
    'def parse_args(argv):\n    """Parse the command line."""',
    "for index, value in enumerate(values):",
    "with open(path) as f:",
    "try:\n    import json\nexcept ImportError:",
    "def __repr__(self):\n        return",
]


@dataclass
class Result:
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    latency: float = 0.0
    output_tokens: int = 0


async def one_request(client: httpx.AsyncClient, body: dict, stream: bool) -> Result:
    """Send one completion; with ``stream``, time each chunk that brings tokens (its
    ``token_ids`` when the body asks for them, else its text)."""
    result = Result()
    start = time.perf_counter()
    if not stream:
        response = await client.post("/v1/completions", json={**body, "stream": False})
        response.raise_for_status()
        result.latency = time.perf_counter() - start
        result.output_tokens = response.json()["usage"]["completion_tokens"]
        return result
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    last = None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            now = time.perf_counter()
            choice = chunk["choices"][0] if chunk["choices"] else {}
            if choice.get("token_ids") or choice.get("text"):
                if last is None:
                    result.ttft = now - start
                else:
                    result.itls.append(now - last)
                last = now
            if chunk.get("usage"):
                result.output_tokens = chunk["usage"]["completion_tokens"]
    result.latency = time.perf_counter() - start
    return result


async def run_load(
    base_url: str, bodies: list[dict], rate: float, stream: bool
) -> tuple[list[Result], float]:
    """Send ``bodies`` with Poisson arrivals at ``rate`` per second (inf: all at once)."""
    rng = random.Random(0)
    limits = httpx.Limits(max_connections=len(bodies) + 8)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=600) as client:
        tasks = []
        start = time.perf_counter()
        for body in bodies:
            tasks.append(asyncio.create_task(one_request(client, body, stream)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def summarize(label: list[str], results: list[Result], elapsed: float) -> list[str]:
    """One table row: ``label`` cells, then req/s, output tok/s, TTFT, ITL, latency."""
    ttfts = [r.ttft for r in results if r.ttft is not None]
    itls = [itl for r in results for itl in r.itls]
    return [
        *label,
        f"{len(results) / elapsed:.2f}",
        f"{sum(r.output_tokens for r in results) / elapsed:.0f}",
        ms(percentile(ttfts, 50)),
        ms(percentile(ttfts, 99)),
        ms(percentile(itls, 50)),
        ms(percentile(itls, 99)),
        ms(statistics.median(r.latency for r in results)),
    ]


SUMMARY_HEADER = [
    "req/s",
    "output tok/s",
    "TTFT p50 ms",
    "TTFT p99 ms",
    "ITL p50 ms",
    "ITL p99 ms",
    "latency p50 ms",
]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def ms(value: float) -> str:
    return "-" if value != value else f"{value * 1000:.0f}"


def start_server(
    max_num_seqs: int, *extra: str, wait_s: float = 120
) -> tuple[subprocess.Popen, str]:
    """``updraft serve`` on the demo model on a free port (``extra``: more flags), once
    /health answers (within ``wait_s``)."""
    port = free_port()
    command = [sys.executable, "-m", "updraft", "serve", "--port", str(port)]
    command += ["--max-num-seqs", str(max_num_seqs), "--max-waiting", "100000", *extra]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError("updraft serve exited at start-up")
        try:
            if httpx.get(f"{base_url}/health").status_code == 200:
                return process, base_url
        except httpx.TransportError:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError("updraft serve did not start")


def canary_rate(base_url: str, tokens: int = 256) -> float:
    """Tokens/s of one greedy stream, from its first chunk to its last."""
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": tokens, "ignore_eos": True}
    body.update(stream=True, return_token_ids=True, temperature=0)
    first = last = None
    count = 0
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=600) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                count += len(json.loads(line[6:])["choices"][0]["token_ids"])
                last = time.perf_counter()
                first = first or last
    return (count - 1) / (last - first)


def hostile(rounds: int, clients: int = 6) -> str:
    process, base_url = start_server(64)
    huge = ("def handler(request):\n    return request.body  # " + "x" * 40 + "\n") * 900
    huge = huge[:86_000]
    rows, sent = [], [0]
    try:
        canary_rate(base_url, 32)  # warm-up
        alone, attacked = [], []
        for _ in range(rounds):
            alone.append(canary_rate(base_url))
            stop = threading.Event()

            def attack(stop: threading.Event = stop) -> None:
                body = {"model": MODEL, "prompt": huge, "max_tokens": 1}
                with httpx.Client(base_url=base_url, timeout=120) as client:
                    while not stop.is_set():
                        assert client.post("/v1/completions", json=body).status_code == 400
                        sent[0] += 1

            threads = [threading.Thread(target=attack) for _ in range(clients)]
            for thread in threads:
                thread.start()
            try:
                attacked.append(canary_rate(base_url))
            finally:
                stop.set()
                for thread in threads:
                    thread.join()
    finally:
        process.terminate()
        process.wait(60)
    rows.append(["alone", f"{max(alone):.1f}", f"{min(alone):.1f}-{max(alone):.1f}", "-"])
    rows.append(
        [
            f"beside {clients} clients of 86k-character prompts",
            f"{max(attacked):.1f}",
            f"{min(attacked):.1f}-{max(attacked):.1f}",
            str(sent[0]),
        ]
    )
    rows.append(["ratio (best)", f"{max(attacked) / max(alone):.2f}x", "", ""])
    return markdown_table(
        f"updraft serve, demo model: a canary stream of 256 tokens, best of {rounds}",
        ["canary", "tokens/s", "range", "hostile prompts answered"],
        rows,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests, for a smoke run")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--hostile", action="store_true", help="huge prompts beside a stream")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.hostile:
        print(hostile(args.rounds))
        return
    num_requests = 16 if args.quick else 64
    max_tokens = 32 if args.quick else 64
    scenarios = [(4.0, True), (16.0, True), (float("inf"), True), (float("inf"), False)]
    process, base_url = start_server(args.max_num_seqs)

    def bodies(count: int, max_tokens: int) -> list[dict]:
        return [
            {
                "model": MODEL,
                "prompt": PROMPTS[index % len(PROMPTS)],
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
            }
            for index in range(count)
        ]

    try:
        asyncio.run(run_load(base_url, bodies(4, 4), float("inf"), True))  # warm-up
        rows = []
        for rate, stream in scenarios:
            results, elapsed = asyncio.run(
                run_load(base_url, bodies(num_requests, max_tokens), rate, stream)
            )
            assert all(r.output_tokens == max_tokens for r in results)
            arrivals = "all at once" if rate == float("inf") else f"{rate:g}/s"
            rows.append(summarize([arrivals, "yes" if stream else "no"], results, elapsed))
    finally:
        process.terminate()
        process.wait(60)
    header = ["arrivals", "stream", *SUMMARY_HEADER]
    title = (
        f"updraft serve, demo model, {num_requests} requests x {max_tokens} tokens, "
        f"max_num_seqs {args.max_num_seqs}"
    )
    print(markdown_table(title, header, rows))


if __name__ == "__main__":
    main()
