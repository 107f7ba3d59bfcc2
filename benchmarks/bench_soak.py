"""Soak: `updraft serve` on the demo model under varied traffic, its memory over time.

Clients send completions with random prompt lengths (token ids, 1 to 1,500), random
output lengths (1 to 200 tokens), streamed or not, and cut a fifth of their streams
early. The resident memory (VmRSS) of the API process and of the engine process (with
multiprocessing's resource tracker, a few MiB) is read every few seconds: after warm-up it
should stay flat, since what grows with new step shapes (compiled graphs, allocator
pools, caches) is bounded.

    .venv/bin/python -m benchmarks.bench_soak [--minutes 10] [--clients 8]
"""

from __future__ import annotations

import argparse
import random
import threading
import time

import httpx

from benchmarks.bench_serve import start_server
from benchmarks.common import markdown_table, process_tree, status_mib

MODEL = "updraft-demo"
VOCAB = 4096  # the demo model's


def rss_row(pid: int) -> list[str]:
    """Resident MiB of the server's API process, of its engine process (and any of the
    engine's own), and their sum."""
    api, *others = process_tree(pid)
    api_mib = status_mib(api, "VmRSS")
    engine_mib = sum(status_mib(p, "VmRSS") for p in others)
    return [f"{api_mib:.0f}", f"{engine_mib:.0f}", f"{api_mib + engine_mib:.0f}"]


def client(base_url: str, seed: int, stop: threading.Event, done: list[int]) -> None:
    rng = random.Random(seed)
    with httpx.Client(base_url=base_url, timeout=300) as http:
        while not stop.is_set():
            prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 1500))]
            body = {
                "model": MODEL,
                "prompt": prompt,
                "max_tokens": rng.randint(1, 200),
                "temperature": rng.choice([0.0, 0.8]),
                "ignore_eos": True,
            }
            if rng.random() < 0.5:
                http.post("/v1/completions", json=body).raise_for_status()
            else:
                cut = rng.random() < 0.2
                with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                    for index, _ in enumerate(r.iter_lines()):
                        if cut and index >= 3:
                            break  # the client goes away mid-stream
            done[0] += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--every", type=float, default=30.0, help="seconds between samples")
    parser.add_argument("--kv-cache-mib", type=int, default=64)
    args = parser.parse_args()
    server, base_url = start_server(64, "--kv-cache-memory-gib", str(args.kv_cache_mib / 1024))
    stop, done, rows = threading.Event(), [0], []
    try:
        rows.append(["ready", "0", *rss_row(server.pid)])
        clients = [
            threading.Thread(target=client, args=(base_url, seed, stop, done), daemon=True)
            for seed in range(args.clients)
        ]
        for thread in clients:
            thread.start()
        start = time.monotonic()
        while time.monotonic() - start < args.minutes * 60:
            time.sleep(args.every)
            minutes = (time.monotonic() - start) / 60
            rows.append([f"{minutes:.1f} min", str(done[0]), *rss_row(server.pid)])
            print(" | ".join(rows[-1]), flush=True)
        stop.set()
        for thread in clients:
            thread.join(300)
    finally:
        server.terminate()
        server.wait(120)
    title = (
        f"updraft serve, demo model, {args.clients} clients of random prompts (1-1,500 "
        f"tokens) and outputs (1-200), a fifth of streams cut, {args.kv_cache_mib} MiB KV"
    )
    header = ["time", "requests done", "API process MiB", "engine process MiB", "total MiB"]
    print(markdown_table(title, header, rows))


if __name__ == "__main__":
    main()
