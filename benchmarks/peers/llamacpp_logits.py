"""llama.cpp's next-token logits over token windows, through llama-cpp-python: for each
window, the argmax at every position but the last, and the summed negative
log-likelihood of each next token. Runs in benchmarks/peers/.venv-llamacpp
(setup_llamacpp.sh), as bench_quality's subprocess.

    python llamacpp_logits.py FILE.gguf < windows.json    (a JSON list of token-id lists)

prints one JSON line: {"top1": [[ids] per window], "nll": total, "tokens": count}.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np


def main(path: str) -> None:
    from llama_cpp import Llama

    windows: list[list[int]] = json.load(sys.stdin)
    length = max(map(len, windows))
    llm = Llama(
        model_path=path,
        n_ctx=length,
        n_batch=length,
        n_ubatch=length,
        n_threads=os.cpu_count(),
        n_threads_batch=os.cpu_count(),
        logits_all=True,  # every position's logits, not the last one's only
        verbose=False,
    )
    top1, nll, tokens = [], 0.0, 0
    for window in windows:
        llm.reset()  # no KV of the previous window
        llm.eval(window)
        logits = np.asarray(llm.scores[: len(window) - 1], dtype=np.float64)
        top1.append(logits.argmax(axis=-1).tolist())
        shifted = logits - logits.max(axis=-1, keepdims=True)
        log_norm = np.log(np.exp(shifted).sum(axis=-1))
        targets = np.asarray(window[1:])
        nll -= float((shifted[np.arange(len(targets)), targets] - log_norm).sum())
        tokens += len(targets)
    print(json.dumps({"top1": top1, "nll": nll, "tokens": tokens}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
