"""Hostile traffic: `updraft serve` on the demo model under requests chosen to hurt,
beside one unrelated stream.

Client threads send ``--requests`` requests mixed from the kinds an attacker tried
(negative and oversized token ids, integers past what the wire carries, stalling
regexes made new by a suffix so no cache helps, constraints that allow no output,
tools whose parameters use ``$defs``, schemas holding huge integers, malformed JSON),
while a greedy stream of the same prompt runs again and again. Its speed is compared
with its speed alone: it should keep at least 0.8x of it, with no 5xx answer at all.
Its speed alone is taken before and after the attack, with every graph captured before
the server answers: a solo stream beside the background captures ran at half speed.

``--plain`` sends the same number of plain completions (8 tokens, no constraint) from
the same clients instead: the stream's speed under ordinary load of that rate, which
tells what the hostile kinds cost beyond the load itself.

    .venv/bin/python -m benchmarks.bench_hostile [--requests 1000] [--clients 4] [--plain]
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import subprocess
import threading
import time
from collections import Counter

import httpx

from benchmarks.bench_serve import start_server
from benchmarks.common import markdown_table

MODEL = "updraft-demo"
PROMPT = "def fibonacci(n):\n    "
STREAM_TOKENS = 256
CITY = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
TOOL_WITH_DEFS = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {
            "$defs": {"City": CITY},
            "type": "object",
            "properties": {"city": {"$ref": "#/$defs/City"}},
            "required": ["city"],
        },
    },
}
MUTUAL_REFS = {
    "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
    "$ref": "#/$defs/a",
}


def completion(**fields) -> tuple[str, dict]:
    return "/v1/completions", {"model": MODEL, "prompt": "x = ", "max_tokens": 8, **fields}


def chat(**fields) -> tuple[str, dict]:
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    return "/v1/chat/completions", {
        "model": MODEL,
        "messages": messages,
        "max_tokens": 24,
        **fields,
    }


def json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def hostile_requests(serial: int) -> dict[str, tuple[str, dict | str]]:
    """One request of each kind, as (path, body); ``serial`` makes a regex new, past
    every cache."""
    huge = 2**80
    return {
        "negative-id": completion(prompt=[[-1, 5]]),
        "negative-id-flat": completion(prompt=[-1, 5]),
        "oversized-id": completion(prompt=[5, 2**40]),
        "huge-logit-bias": completion(logit_bias={str(huge): 1}),
        "huge-stop-id": completion(stop_token_ids=[huge]),
        "huge-allowed-id": chat(allowed_token_ids=[huge]),
        "stalling-regex": completion(guided_regex=f"a{{1000}}{{1000}}b{serial}"),
        "nested-repeat-regex": completion(guided_regex=f"x(a{{300}}{{300}}b){serial}"),
        "impossible-ids": completion(guided_regex="[0-9]{3}", allowed_token_ids=[1]),
        "self-ref": completion(guided_json={"$ref": "#"}),
        "mutual-refs": completion(guided_json=MUTUAL_REFS),
        "empty-class": completion(guided_regex=r"[^\s\S]"),
        "defs-tool": chat(tools=[TOOL_WITH_DEFS], tool_choice="required"),
        "huge-enum": chat(response_format=json_schema({"enum": [10**30]})),
        "huge-minimum": chat(response_format=json_schema({"type": "integer", "minimum": 1e30})),
        "malformed-json": ("/v1/completions", f'{{"model": "{MODEL}", "prompt": [1, 2'),
    }


KINDS = list(hostile_requests(0))
SOLO_STREAMS = 5  # before the attack, and as many after
PLAIN = "plain"


def request_of(kind: str, serial: int) -> tuple[str, dict | str]:
    if kind == PLAIN:
        return completion(prompt=f"x = {serial}")
    return hostile_requests(serial)[kind]


def stream_once(base_url: str, tokens: int = STREAM_TOKENS) -> tuple[int, float, float]:
    """One greedy stream: (tokens after its first chunk, seconds from its first chunk to
    its last, the largest gap between chunks). The first chunk's tokens were made before
    the clock started: counted, a first chunk that carried several inflated the rate."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": tokens, "ignore_eos": True}
    body.update(stream=True, return_token_ids=True, temperature=0)
    arrivals, counts = [], []
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=600) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                counts.append(len(json.loads(line[6:])["choices"][0]["token_ids"]))
                arrivals.append(time.perf_counter())
    gaps = [later - earlier for earlier, later in itertools.pairwise(arrivals)]
    return sum(counts[1:]), arrivals[-1] - arrivals[0], max(gaps, default=0.0)


def spread_of(streams: list[tuple[int, float, float]]) -> str:
    """The slowest and fastest stream's tokens/s."""
    rates = [count / seconds for count, seconds, _ in streams]
    return f"{min(rates):.0f}-{max(rates):.0f}"


def attacker(
    base_url: str, jobs: list[tuple[str, int]], statuses: Counter, lock: threading.Lock
) -> None:
    with httpx.Client(base_url=base_url, timeout=120) as http:
        while True:
            with lock:
                if not jobs:
                    return
                kind, serial = jobs.pop()
            path, body = request_of(kind, serial)
            try:
                if isinstance(body, str):  # raw text, for what a dict cannot express
                    headers = {"content-type": "application/json"}
                    status = http.post(path, content=body, headers=headers).status_code
                else:
                    status = http.post(path, json=body).status_code
            except httpx.HTTPError as error:
                status = type(error).__name__
            with lock:
                statuses[(kind, status)] += 1


def stop_server(server: subprocess.Popen) -> bool:
    """SIGTERM, which drains; whether the server exited within a minute (else killed)."""
    server.terminate()
    try:
        server.wait(60)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=1000, help="hostile requests in all")
    parser.add_argument("--clients", type=int, default=4, help="threads sending them")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plain", action="store_true", help="plain completions instead")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    kinds = [PLAIN] if args.plain else KINDS
    jobs = [(rng.choice(kinds), serial) for serial in range(args.requests)]
    server, base_url = start_server(64, "--no-graphs-in-background", wait_s=900)
    try:
        stream_once(base_url, 32)  # warm-up
        solo = [stream_once(base_url) for _ in range(SOLO_STREAMS)]
        statuses: Counter = Counter()
        lock = threading.Lock()
        threads = [
            threading.Thread(target=attacker, args=(base_url, jobs, statuses, lock), daemon=True)
            for _ in range(args.clients)
        ]
        start = time.monotonic()
        for thread in threads:
            thread.start()
        attacked = []
        while any(thread.is_alive() for thread in threads):
            attacked.append(stream_once(base_url))
        attack_seconds = time.monotonic() - start
        solo += [stream_once(base_url) for _ in range(SOLO_STREAMS)]
    finally:
        drained = stop_server(server)
    solo_rate = sum(c for c, _, _ in solo) / sum(s for _, s, _ in solo)
    attacked_rate = sum(c for c, _, _ in attacked) / sum(s for _, s, _ in attacked)
    spread = {"solo": spread_of(solo), "attacked": spread_of(attacked)}
    # A 5xx, or no answer at all (the connection dropped: a transport error's name).
    server_errors = sum(
        n for (_, status), n in statuses.items() if not isinstance(status, int) or status >= 500
    )
    what = "Plain" if args.plain else "Hostile"
    print(f"# {what} traffic: {args.requests} requests from {args.clients} clients\n")
    print(f"The demo model; the attack lasted {attack_seconds:.1f} s.\n")
    rows = [
        [
            f"alone ({len(solo)} streams, before and after)",
            f"{solo_rate:.1f}",
            spread["solo"],
            f"{max(g for _, _, g in solo) * 1e3:.0f}",
            "1.00",
        ],
        [
            f"under attack ({len(attacked)} streams)",
            f"{attacked_rate:.1f}",
            spread["attacked"],
            f"{max(g for _, _, g in attacked) * 1e3:.0f}",
            f"{attacked_rate / solo_rate:.2f}",
        ],
    ]
    columns = ["", "tok/s", "streams' tok/s, min-max", "largest gap (ms)", "x"]
    print(markdown_table("The unrelated stream", columns, rows))
    print()
    by_status = Counter()
    for (_, status), count in statuses.items():
        by_status[status] += count
    print(
        markdown_table(
            "Answers",
            ["status", "count"],
            [[str(s), str(n)] for s, n in sorted(by_status.items(), key=str)],
        )
    )
    print()
    per_kind = [
        [
            kind,
            ", ".join(f"{s} x{n}" for (k, s), n in sorted(statuses.items(), key=str) if k == kind),
        ]
        for kind in kinds
    ]
    print(markdown_table("Answers per kind", ["kind", "statuses"], per_kind))
    print()
    if not drained:
        print("The server did not drain within 60 s of SIGTERM: it was killed.\n")
    verdict = attacked_rate >= 0.8 * solo_rate and server_errors == 0
    print(
        f"{'PASS' if verdict else 'FAIL'}: {attacked_rate / solo_rate:.2f}x, {server_errors} x 5xx"
    )


if __name__ == "__main__":
    main()
