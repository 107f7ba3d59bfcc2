"""Soak: `updraft serve` on the demo model under varied traffic, its memory over time.

Clients send completions with random prompt lengths (token ids, 1 to 1,500), random
output lengths (1 to 200 tokens), streamed or not, and cut a fifth of their streams
early. The resident memory (VmRSS) of the API process and of the engine process (with
multiprocessing's resource tracker, a few MiB) is read every few seconds: after warm-up it
should stay flat, since what grows with new step shapes (compiled graphs, allocator
pools, caches) is bounded. It runs for ``--minutes`` or until ``--requests`` requests are
done, whichever comes first, and prints the curve as a table for RESULTS.md.

    .venv/bin/python -m benchmarks.bench_soak [--minutes 10] [--clients 8]
    .venv/bin/python -m benchmarks.bench_soak --requests 10500 --every 60
"""

from __future__ import annotations

import argparse
import random
import sys
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


class Budget:
    """The requests the clients may still start (None: no limit), and those done."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.started = self.done = 0
        self._lock = threading.Lock()

    def claim(self) -> bool:
        with self._lock:
            if self.limit is not None and self.started >= self.limit:
                return False
            self.started += 1
            return True

    def finished(self) -> None:
        with self._lock:
            self.done += 1


def client(base_url: str, seed: int, stop: threading.Event, budget: Budget) -> None:
    rng = random.Random(seed)
    with httpx.Client(base_url=base_url, timeout=300) as http:
        while not stop.is_set() and budget.claim():
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
                    r.raise_for_status()
                    for index, _ in enumerate(r.iter_lines()):
                        if cut and index >= 3:
                            break  # the client goes away mid-stream
            budget.finished()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, help="10 unless --requests is given")
    parser.add_argument("--requests", type=int, help="stop once this many are done")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--every", type=float, default=30.0, help="seconds between samples")
    parser.add_argument("--kv-cache-mib", type=int, default=64)
    args = parser.parse_args()
    minutes = args.minutes if args.minutes is not None or args.requests else 10.0
    server, base_url = start_server(64, "--kv-cache-memory-gib", str(args.kv_cache_mib / 1024))
    stop, budget = threading.Event(), Budget(args.requests)
    rows = [["ready", "0", *rss_row(server.pid)]]
    try:
        clients = [
            threading.Thread(target=client, args=(base_url, seed, stop, budget), daemon=True)
            for seed in range(args.clients)
        ]
        for thread in clients:
            thread.start()
        start = next_sample = time.monotonic()
        while any(thread.is_alive() for thread in clients):
            elapsed = time.monotonic() - start
            if minutes is not None and elapsed >= minutes * 60:
                break
            time.sleep(min(0.5, args.every))
            if time.monotonic() >= next_sample + args.every:
                next_sample += args.every
                rows.append(sample(start, budget, server.pid))
        stop.set()
        for thread in clients:
            thread.join(300)
        if rows[-1][1] != str(budget.done):  # the end, unless the last sample was it
            rows.append(sample(start, budget, server.pid))
    finally:
        server.terminate()
        server.wait(120)
    if args.requests and budget.done < args.requests:
        print(f"only {budget.done} of {args.requests} requests done", file=sys.stderr)
    title = (
        f"updraft serve, demo model, {args.clients} clients of random prompts (1-1,500 "
        f"tokens) and outputs (1-200), a fifth of streams cut, {args.kv_cache_mib} MiB KV, "
        f"{budget.done} requests"
    )
    header = ["time", "requests done", "API process MiB", "engine process MiB", "total MiB"]
    print("    .venv/bin/python -m benchmarks.bench_soak " + " ".join(sys.argv[1:]))
    print(markdown_table(title, header, rows))


def sample(start: float, budget: Budget, pid: int) -> list[str]:
    """A row of the curve: minutes since the clients started, requests done, RSS."""
    row = [f"{(time.monotonic() - start) / 60:.1f} min", str(budget.done), *rss_row(pid)]
    print(" | ".join(row), flush=True)
    return row


if __name__ == "__main__":
    main()
