"""Train the tiny demo checkpoints that updraft ships in ``updraft/assets/demo``.

The corpus is the Python standard library's own ``.py`` source, taken from the running
interpreter (``sysconfig.get_paths()["stdlib"]``), minus ``site-packages`` and the
``test``/``tests``/``idlelib``/``lib2to3`` directories. Files are sorted and split by a
stable hash of their relative path (``zlib.crc32(path) % 20 == 0`` goes to held-out),
and joined with an ``<|endoftext|>`` token.

The script then:

1. trains a byte-level BPE tokenizer (vocab 4096, ``<|endoftext|>`` = id 0 = EOS) on the
   train split with the ``tokenizers`` library;
2. trains two ``LlamaForCausalLM`` models in float32 on random contiguous 256-token windows
   of the train split (AdamW, linear warmup + cosine decay): a ~5M-parameter *target* and a
   ~1.5M-parameter *draft* that shares the tokenizer, for speculative decoding demos;
3. measures held-out cross-entropy (nats/token) on a fixed, seeded set of held-out windows;
4. saves each model in float16 as a self-contained Hugging Face checkpoint directory
   (config, generation config, safetensors weights, tokenizer files) plus ``TRAINING.json``.

Everything is seeded and the data order is fixed, so for a given Python version (which
determines the corpus) and library versions the run is reproducible, up to floating-point
non-associativity in multi-threaded CPU kernels.

Usage::

    python scripts/train_demo.py --out updraft/assets/demo
    python scripts/train_demo.py --only draft --draft-steps 100
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import sysconfig
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

EOS_TOKEN = "<|endoftext|>"
EOS_ID = 0
VOCAB_SIZE = 4096
MAX_POSITIONS = 2048
SKIP_DIRS = frozenset({"site-packages", "test", "tests", "idlelib", "lib2to3"})
HELDOUT_MODULUS = 20
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class ModelSpec:
    """Architecture of one demo model."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int


@dataclass(frozen=True)
class TrainSpec:
    """Optimisation settings of one training run."""

    steps: int
    batch_size: int
    seq_len: int
    lr: float
    min_lr_ratio: float
    warmup_frac: float
    weight_decay: float
    grad_clip: float
    seed: int


MODEL_SPECS: dict[str, ModelSpec] = {
    "target": ModelSpec(256, 6, 8, 4, 704),
    "draft": ModelSpec(128, 4, 4, 2, 384),
}


@dataclass(frozen=True)
class Corpus:
    """The stdlib corpus, split into train and held-out files."""

    stdlib: Path
    train: list[tuple[str, str]]
    heldout: list[tuple[str, str]]


# --------------------------------------------------------------------------- corpus


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def is_skipped(rel: Path) -> bool:
    return any(part in SKIP_DIRS for part in rel.parts[:-1])


def is_heldout(rel: str) -> bool:
    return zlib.crc32(rel.encode("utf-8")) % HELDOUT_MODULUS == 0


def load_corpus(root: Path) -> Corpus:
    """Read the stdlib ``.py`` files in sorted order and split them by path hash."""
    train: list[tuple[str, str]] = []
    heldout: list[tuple[str, str]] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if is_skipped(rel) or not path.is_file():
            continue
        text = path.read_bytes().decode("utf-8", errors="replace")
        (heldout if is_heldout(rel.as_posix()) else train).append((rel.as_posix(), text))
    return Corpus(stdlib=root, train=train, heldout=heldout)


# --------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Train a byte-level BPE tokenizer with ``<|endoftext|>`` as id 0."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    assert tokenizer.token_to_id(EOS_TOKEN) == EOS_ID
    return tokenizer


def tokenizer_config() -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "model_max_length": MAX_POSITIONS,
        "clean_up_tokenization_spaces": False,
        "add_prefix_space": False,
    }


def save_tokenizer(tokenizer: Tokenizer, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    write_json(out_dir / "tokenizer_config.json", tokenizer_config())


def encode_files(tokenizer: Tokenizer, texts: list[str]) -> torch.Tensor:
    """Encode files and join them into one stream, each file followed by EOS."""
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.extend(encoding.ids)
        ids.append(EOS_ID)
    return torch.tensor(ids, dtype=torch.long)


# --------------------------------------------------------------------------- model


def build_config(spec: ModelSpec) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        intermediate_size=spec.intermediate_size,
        max_position_embeddings=MAX_POSITIONS,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=EOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=EOS_ID,
        attn_implementation="sdpa",
    )


def count_params(model: torch.nn.Module) -> int:
    """Unique parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())


def sample_windows(
    data: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator
) -> torch.Tensor:
    """``batch_size`` random contiguous windows of ``seq_len + 1`` tokens."""
    starts = torch.randint(0, data.numel() - seq_len - 1, (batch_size,), generator=generator)
    offsets = torch.arange(seq_len + 1)
    return data[starts[:, None] + offsets[None, :]]


def lm_loss(model: LlamaForCausalLM, windows: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=windows[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), windows[:, 1:].reshape(-1))


def lr_at(step: int, spec: TrainSpec) -> float:
    """Linear warmup, then cosine decay to ``min_lr_ratio * lr``."""
    warmup = max(1, int(spec.warmup_frac * spec.steps))
    if step < warmup:
        return spec.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, spec.steps - warmup)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return spec.lr * (spec.min_lr_ratio + (1.0 - spec.min_lr_ratio) * cosine)


def make_optimizer(model: torch.nn.Module, spec: TrainSpec) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not norms)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": spec.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=spec.lr, betas=(0.9, 0.95), eps=1e-8)


def train_model(
    name: str, model_spec: ModelSpec, spec: TrainSpec, data: torch.Tensor
) -> tuple[LlamaForCausalLM, float]:
    """Train one model in float32; returns the model and the training wall time."""
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(build_config(model_spec)).float()
    model.train()
    optimizer = make_optimizer(model, spec)
    generator = torch.Generator().manual_seed(spec.seed)
    print(f"[{name}] {count_params(model):,} parameters, {spec.steps} steps", flush=True)
    start = time.perf_counter()
    for step in range(spec.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, spec)
        loss = lm_loss(model, sample_windows(data, spec.batch_size, spec.seq_len, generator))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.grad_clip)
        optimizer.step()
        if step % 25 == 0 or step == spec.steps - 1:
            elapsed = time.perf_counter() - start
            print(
                f"[{name}] step {step:5d}  loss {loss.item():.4f}  "
                f"lr {lr_at(step, spec):.2e}  {elapsed:7.1f}s",
                flush=True,
            )
    return model, time.perf_counter() - start


@torch.no_grad()
def heldout_loss(
    model: LlamaForCausalLM, data: torch.Tensor, windows: int, seq_len: int, seed: int
) -> float:
    """Mean cross-entropy (nats/token) over a fixed, seeded set of held-out windows."""
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    batch = sample_windows(data, windows, seq_len, generator)
    losses = [lm_loss(model, chunk).item() for chunk in batch.split(16)]
    sizes = [chunk.size(0) for chunk in batch.split(16)]
    return sum(loss * n for loss, n in zip(losses, sizes, strict=True)) / sum(sizes)


def save_model(model: LlamaForCausalLM, tokenizer: Tokenizer, out_dir: Path) -> None:
    """Save a float16, self-contained Hugging Face checkpoint directory."""
    model = model.to(torch.float16)
    model.config.dtype = torch.float16
    model.generation_config = GenerationConfig(
        bos_token_id=EOS_ID, eos_token_id=EOS_ID, pad_token_id=EOS_ID
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    add_legacy_config_keys(out_dir / "config.json")
    save_tokenizer(tokenizer, out_dir)
    for path in out_dir.iterdir():
        path.chmod(0o644)  # safetensors writes 0600 files; these are package data


def add_legacy_config_keys(path: Path) -> None:
    """Also write ``torch_dtype`` and top-level ``rope_theta`` for pre-v5 readers."""
    config = json.loads(path.read_text())
    config["torch_dtype"] = config.get("dtype", "float16")
    config["rope_theta"] = config.get("rope_parameters", {}).get("rope_theta", 10000.0)
    write_json(path, config)


# --------------------------------------------------------------------------- driver


def write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("updraft/assets/demo"))
    parser.add_argument("--only", choices=["all", "tokenizer", "target", "draft"], default="all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target-steps", type=int, default=2000)
    parser.add_argument("--draft-steps", type=int, default=1000)
    parser.add_argument("--target-batch-size", type=int, default=8)
    parser.add_argument("--draft-batch-size", type=int, default=8)
    parser.add_argument("--target-lr", type=float, default=3e-3)
    parser.add_argument("--draft-lr", type=float, default=3e-3)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--eval-windows", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    return parser.parse_args(argv)


def train_spec(args: argparse.Namespace, name: str) -> TrainSpec:
    return TrainSpec(
        steps=getattr(args, f"{name}_steps"),
        batch_size=getattr(args, f"{name}_batch_size"),
        seq_len=args.seq_len,
        lr=getattr(args, f"{name}_lr"),
        min_lr_ratio=0.1,
        warmup_frac=0.05,
        weight_decay=0.1,
        grad_clip=1.0,
        seed=args.seed,
    )


def run_model(
    name: str,
    args: argparse.Namespace,
    tokenizer: Tokenizer,
    train: torch.Tensor,
    heldout: torch.Tensor,
) -> dict[str, Any]:
    spec = train_spec(args, name)
    model, wall = train_model(name, MODEL_SPECS[name], spec, train)
    loss = heldout_loss(model, heldout, args.eval_windows, args.seq_len, args.seed + 1)
    print(f"[{name}] held-out loss {loss:.4f} nats/token, trained in {wall:.1f}s", flush=True)
    save_model(model, tokenizer, args.out / name)
    return {
        "architecture": asdict(MODEL_SPECS[name]),
        "training": asdict(spec),
        "parameters": count_params(model),
        "heldout_loss_nats_per_token": round(loss, 4),
        "train_wall_time_s": round(wall, 1),
        "tokens_seen": spec.steps * spec.batch_size * spec.seq_len,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()

    corpus = load_corpus(stdlib_dir())
    tokenizer = train_tokenizer([text for _, text in corpus.train])
    train = encode_files(tokenizer, [text for _, text in corpus.train])
    heldout = encode_files(tokenizer, [text for _, text in corpus.heldout])
    print(
        f"corpus: {len(corpus.train)} train files / {train.numel():,} tokens, "
        f"{len(corpus.heldout)} held-out files / {heldout.numel():,} tokens",
        flush=True,
    )

    names = ["target", "draft"] if args.only in ("all", "tokenizer") else [args.only]
    for name in names:
        save_tokenizer(tokenizer, args.out / name)

    report_path = args.out / "TRAINING.json"
    report: dict[str, Any] = json.loads(report_path.read_text()) if report_path.exists() else {}
    report.update(
        {
            "python_version": platform.python_version(),
            "python_implementation": sys.implementation.name,
            "torch_version": torch.__version__,
            "stdlib_path": str(corpus.stdlib),
            "skipped_dirs": sorted(SKIP_DIRS),
            "heldout_rule": f"zlib.crc32(relative_path) % {HELDOUT_MODULUS} == 0",
            "train_files": len(corpus.train),
            "heldout_files": len(corpus.heldout),
            "train_tokens": train.numel(),
            "heldout_tokens": heldout.numel(),
            "vocab_size": VOCAB_SIZE,
            "eos_token": EOS_TOKEN,
            "seed": args.seed,
            "seq_len": args.seq_len,
            "eval_windows": args.eval_windows,
            "threads": args.threads,
        }
    )
    if args.only != "tokenizer":
        for name in names:
            report[name] = run_model(name, args, tokenizer, train, heldout)
    report["last_run_wall_time_s"] = round(time.perf_counter() - started, 1)
    write_json(report_path, report)
    print(f"wrote {args.out} ({dir_size(args.out) / 1e6:.2f} MB)", flush=True)


if __name__ == "__main__":
    main()
