"""What llama.cpp's quantized GGUF files cost in quality in updraft, per block type and
activation mode (float32 x, int8 x), on the demo model.

The demo model (``updraft/assets/demo/target``, trained, so its next-token
distributions mean something where the random benchmark models' do not) is written as
F32 by llama.cpp's own converter (``tests/llama_cpp_tree.py``) and quantized from that by
llama.cpp's own quantizer (``benchmarks/peers/gguf_file.py``) to each file type. The
held-out text is the demo's held-out split of the Python standard library
(``scripts/train_demo.py``: 34 files the model never trained on, chosen by a hash of
their path; ``bench_formats`` reads the same): ``--windows`` seeded windows of
``--length`` tokens, every token after a window's first scored. Per file and mode:

* mean KL(float32 model || this file in this mode), nats a token: the float32 model is
  the demo checkpoint in updraft, float32 weights and activations;
* perplexity of the held-out tokens, and llama.cpp's on the same file;
* top-1 agreement with llama.cpp on the same file: the share of positions where
  updraft's likeliest next token is llama.cpp's (llama-cpp-python, ``logits_all``, in
  benchmarks/peers/.venv-llamacpp);
* the block types of the file's matrices: the demo's MLP rows (704 values) are not whole
  256-value blocks, so there a K or IQ type falls back to a 32-value type, as
  llama-quantize chooses.

updraft's logits are every prompt row ``SamplingParams.prompt_logprobs`` scores, caught
whole as the engine's step hands them to ``runner.prompt_logprobs`` (the engine runs in
this process) and checked against the scores the engine returns. A type updraft
refuses in a mode shows "refused" and why.

    .venv/bin/python -m benchmarks.bench_quality [--windows 32] [--types Q8_0,Q4_K_M]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import tempfile
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from gguf import GGUFReader
from tokenizers import Tokenizer

import updraft.runner.runner as runner_module
from benchmarks.bench_formats import train_demo_module
from benchmarks.bench_peers import PEERS, PYTHONS
from benchmarks.common import markdown_table
from tests.llama_cpp_tree import convert
from updraft import LLM, SamplingParams
from updraft.demo import DEMO_MODEL_DIR
from updraft.step.prompt_rows import PromptRows

FILE_TYPES = (
    *("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K_M"),
    *("Q4_K_M", "Q5_K_M", "Q6_K", "IQ4_NL", "IQ4_XS"),
)
MODES = ("float32", "int8")


def held_out_windows(count: int, length: int) -> torch.Tensor:
    """[count, length] token ids: seeded windows of the demo's held-out files."""
    demo = train_demo_module()
    corpus = demo.load_corpus(demo.stdlib_dir())
    tokenizer = Tokenizer.from_file(str(DEMO_MODEL_DIR / "tokenizer.json"))
    data = demo.encode_files(tokenizer, [text for _, text in corpus.heldout])
    return demo.sample_windows(data, count, length - 1, torch.Generator().manual_seed(1))


def gguf_files(work: Path, file_types: list[str]) -> dict[str, Path]:
    """The demo model as llama.cpp's converter writes it (F32) and quantized to each type."""
    source = work / "demo-f32.gguf"
    if not source.is_file():
        convert(DEMO_MODEL_DIR, source, "f32")
    files = {"F32": source}
    for file_type in file_types:
        files[file_type] = work / f"demo-{file_type.lower()}.gguf"
        if not files[file_type].is_file():
            command = [PYTHONS["llama.cpp"], PEERS / "gguf_file.py", "quantize", source]
            subprocess.run([*command, files[file_type], file_type], check=True, capture_output=True)
    return files


def matrix_types(path: Path) -> str:
    """How many of the file's matrices are in each block type, most first."""
    counts = Counter(t.tensor_type.name for t in GGUFReader(str(path)).tensors if len(t.shape) == 2)
    return ", ".join(f"{name} {n}" for name, n in counts.most_common())


@contextmanager
def captured_prompt_rows() -> Iterator[dict[str, dict[int, torch.Tensor]]]:
    """While open: the logits of every prompt row the engine scores, by request id and
    the prompt position each row scores (the engine must run in this process)."""
    seen: dict[str, dict[int, torch.Tensor]] = {}
    original = runner_module.prompt_logprobs

    def capture(logits: torch.Tensor, rows: PromptRows) -> object:
        start = 0
        for request_id, first, count in zip(
            rows.request_ids, rows.first_positions, rows.counts, strict=True
        ):
            by_position = seen.setdefault(request_id, {})
            for offset in range(count):
                by_position[first + offset] = logits[start + offset].float().clone()
            start += count
        return original(logits, rows)

    runner_module.prompt_logprobs = capture
    try:
        yield seen
    finally:
        runner_module.prompt_logprobs = original


def updraft_log_probs(model: Path, windows: torch.Tensor, **engine: object) -> torch.Tensor:
    """[windows, length - 1, vocab]: updraft's next-token log-probabilities after each
    token of each window but the last."""
    length = windows.shape[1]
    llm = LLM(
        str(model),
        dtype="float32",
        enforce_eager=True,
        kv_cache_memory_gib=0.25,
        max_num_batched_tokens=max(2048, length),
        **engine,
    )
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, prompt_logprobs=0)
    try:
        with captured_prompt_rows() as seen:
            outputs = llm.generate(windows.tolist(), [params] * len(windows))
    finally:
        llm.engine.close()
    out = []
    for window, output in zip(windows, outputs, strict=True):
        rows = seen[output.request_id]
        log_probs = torch.stack([rows[p] for p in range(1, length)]).log_softmax(-1)
        ours = log_probs.gather(-1, window[1:, None])[:, 0]
        returned = [output.prompt_logprobs[p][int(window[p])] for p in range(1, length)]
        if not torch.allclose(ours, torch.tensor(returned), atol=1e-3):
            raise RuntimeError(f"{model}: the caught rows are not the prompt rows scored")
        out.append(log_probs)
    return torch.stack(out)


def llamacpp_scores(path: Path, windows: torch.Tensor) -> dict:
    """llama.cpp's top-1 ids per position and perplexity on ``path``, in its venv."""
    done = subprocess.run(
        [PYTHONS["llama.cpp"], PEERS / "llamacpp_logits.py", path],
        input=json.dumps(windows.tolist()),
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"llama.cpp on {path.name} failed:\n{done.stderr[-3000:]}")
    report = json.loads(done.stdout.strip().splitlines()[-1])
    report["top1"] = torch.tensor(report["top1"])
    report["perplexity"] = math.exp(report["nll"] / report["tokens"])
    return report


def scores(
    log_probs: torch.Tensor, reference: torch.Tensor, windows: torch.Tensor, theirs: dict
) -> list[str]:
    """[mean KL from the reference, perplexity, top-1 agreement with llama.cpp] cells."""
    kl = (
        F.kl_div(log_probs, reference, log_target=True, reduction="sum") / log_probs[..., 0].numel()
    )
    nll = -log_probs.gather(-1, windows[:, 1:, None]).mean()
    agree = (log_probs.argmax(-1) == theirs["top1"]).float().mean()
    return [f"{float(kl):.5f}", f"{math.exp(float(nll)):.3f}", f"{float(agree):.4f}"]


def quality_rows(
    files: dict[str, Path], windows: torch.Tensor, reference: torch.Tensor
) -> Iterator[list[str]]:
    for file_type, path in files.items():
        theirs = llamacpp_scores(path, windows)
        for mode in MODES if file_type != "F32" else ("float32",):
            try:
                log_probs = updraft_log_probs(path, windows, activations=mode)
            except (ValueError, TypeError, NotImplementedError) as error:
                cells = [f"refused: {str(error).splitlines()[0]}", "-", "-"]
            else:
                cells = scores(log_probs, reference, windows, theirs)
            yield [
                file_type,
                f"{mode} x",
                matrix_types(path),
                *cells[:2],
                f"{theirs['perplexity']:.3f}",
                cells[2],
            ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--windows", type=int, default=32, help="held-out windows")
    parser.add_argument("--length", type=int, default=256, help="tokens a window")
    parser.add_argument("--types", default=",".join(FILE_TYPES), help="llama-quantize types")
    parser.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "quality")
    args = parser.parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    if not PYTHONS["llama.cpp"].exists():  # it quantizes the files too
        raise SystemExit("run benchmarks/peers/setup_llamacpp.sh first")
    windows = held_out_windows(args.windows, args.length)
    files = gguf_files(args.work_dir, args.types.split(","))
    reference = updraft_log_probs(DEMO_MODEL_DIR, windows)
    own = -reference.gather(-1, windows[:, 1:, None]).mean()
    rows = [["float32 model", "float32 x", "F32 (the checkpoint)", "0", f"{math.exp(own):.3f}"]]
    rows[0] += ["-", "-"]
    rows += quality_rows(files, windows, reference)
    header = ["file", "activations", "matrices' block types", "mean KL from float32, nats"]
    header += ["perplexity", "llama.cpp's perplexity", "top-1 = llama.cpp's"]
    title = (
        f"GGUF quality, demo model, {args.windows} held-out windows x {args.length} tokens "
        f"({args.windows * (args.length - 1)} scored)"
    )
    print(markdown_table(title, header, rows))


if __name__ == "__main__":
    main()
