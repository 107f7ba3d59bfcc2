"""Train the EAGLE-1 draft head that updraft ships for its demo target.

An EAGLE-1 head drafts from the target's own final hidden states: at position i it reads
the embedding of token i + 1 beside the target's hidden state f_i,

    h = fc([embed(t_{i+1}) ; f_i])          (fc: 2H -> H, with a bias)
    h = one Llama decoder layer (no input norm, as EAGLE-1 publishes its heads)

and h is its guess at f_{i+1}; the target's LM head turns h into a guess at token i + 2.
The target stays frozen. The loss is EAGLE's: a smooth-L1 regression of h onto f_{i+1},
plus a cross-entropy of the head's token distribution against the target's own
distribution at i + 1 (soft labels). The features the head reads are perturbed by
uniform noise, as in EAGLE, so that it tolerates reading its own (imperfect) guesses
when it drafts more than one token; with ``--unroll 2`` each batch is also run a second
time with the head's own guesses in place of the target's features (half the steps see
both), which trains exactly that.

The corpus, split and tokenizer are the demo models' (``scripts/train_demo.py``): the
Python standard library's source, with the held-out files excluded from training. The
head is saved in the layout EAGLE heads are published in: ``config.json`` (a one-layer
``LlamaForCausalLM`` config) and ``model.safetensors`` holding ``fc.*`` and
``layers.0.*`` in float16; its embedding and LM head are the target's.

Usage::

    python scripts/train_eagle.py --out updraft/assets/demo/eagle
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer
from torch import nn
from train_demo import (
    TrainSpec,
    count_params,
    encode_files,
    load_corpus,
    lr_at,
    make_optimizer,
    sample_windows,
    stdlib_dir,
    write_json,
)
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

DEMO = Path(__file__).resolve().parent.parent / "updraft" / "assets" / "demo"


class EagleHead(nn.Module):
    """fc over [embedding ; feature], then one decoder layer whose input norm is absent."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=True)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, 0)])
        self.layers[0].input_layernorm = nn.Identity()
        self.rotary = LlamaRotaryEmbedding(config)

    def forward(self, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        hidden = self.fc(torch.cat([embeds, features], dim=-1))
        length = hidden.shape[1]
        positions = torch.arange(length)[None]
        mask = torch.full((length, length), float("-inf")).triu(1)[None, None]
        return self.layers[0](
            hidden,
            attention_mask=mask,
            position_ids=positions,
            position_embeddings=self.rotary(hidden, positions),
        )


def head_config(target: LlamaConfig) -> LlamaConfig:
    config = LlamaConfig(**target.to_dict())
    config.num_hidden_layers = 1
    config.architectures = ["LlamaForCausalLM"]
    config._attn_implementation = "sdpa"  # noqa: SLF001 - transformers has no public setter
    return config


def head_losses(
    head: EagleHead,
    target: LlamaForCausalLM,
    windows: torch.Tensor,
    noise: float,
    unroll: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(regression, cross-entropy, top-1 agreement with the target) over ``windows``
    [B, S + 1], averaged over the unrolled passes."""
    with torch.no_grad():
        features = target.model(input_ids=windows).last_hidden_state  # [B, S+1, H]
        wanted = F.softmax(target.lm_head(features[:, 1:]).float(), dim=-1)
        embeds = target.model.embed_tokens(windows[:, 1:])
    inputs = features[:, :-1]
    regression = cross_entropy = agreement = 0.0
    for _ in range(unroll):
        if noise:
            inputs = inputs + (torch.rand_like(inputs) * 2 - 1) * noise
        guesses = head(embeds, inputs)
        logits = target.lm_head(guesses).float()
        regression = regression + F.smooth_l1_loss(guesses, features[:, 1:])
        cross_entropy = cross_entropy - (wanted * F.log_softmax(logits, -1)).sum(-1).mean()
        agreement = agreement + (logits.argmax(-1) == wanted.argmax(-1)).float().mean()
        # The next pass reads the head's own guess at f_i (made at i - 1) where it read
        # the target's, as a draft step after the first does.
        inputs = torch.cat([features[:, :1], guesses[:, :-1]], dim=1)
    return regression / unroll, cross_entropy / unroll, agreement / unroll


def train(
    head: EagleHead,
    target: LlamaForCausalLM,
    spec: TrainSpec,
    data: torch.Tensor,
    args: argparse.Namespace,
) -> float:
    optimizer = make_optimizer(head, spec)
    generator = torch.Generator().manual_seed(spec.seed)
    start = time.perf_counter()
    for step in range(spec.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, spec)
        windows = sample_windows(data, spec.batch_size, spec.seq_len, generator)
        unroll = args.unroll if step % 2 else 1
        regression, cross_entropy, agreement = head_losses(
            head, target, windows, args.noise, unroll
        )
        loss = regression + args.cls_weight * cross_entropy
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), spec.grad_clip)
        optimizer.step()
        if step % 25 == 0 or step == spec.steps - 1:
            print(
                f"[eagle] step {step:5d}  regression {regression.item():.4f}  "
                f"cross-entropy {cross_entropy.item():.4f}  top-1 {agreement.item():.3f}  "
                f"lr {lr_at(step, spec):.2e}  {time.perf_counter() - start:7.1f}s",
                flush=True,
            )
    return time.perf_counter() - start


@torch.no_grad()
def evaluate(
    head: EagleHead, target: LlamaForCausalLM, data: torch.Tensor, args: argparse.Namespace
) -> dict[str, float]:
    """Held-out losses and how often the head's top token is the target's, reading the
    target's features (first draft) and its own guesses (the drafts after)."""
    head.eval()
    generator = torch.Generator().manual_seed(args.seed + 1)
    windows = sample_windows(data, args.eval_windows, args.seq_len, generator)
    results = {}
    for unroll, name in ((1, "features"), (2, "own_guesses")):
        totals = torch.zeros(3)
        for chunk in windows.split(16):
            if unroll == 1:
                losses = head_losses(head, target, chunk, 0.0, 1)
            else:  # the second pass alone: 2 * mean(both) - first
                both = head_losses(head, target, chunk, 0.0, 2)
                first = head_losses(head, target, chunk, 0.0, 1)
                losses = tuple(2 * b - f for b, f in zip(both, first, strict=True))
            totals += torch.tensor([value.item() for value in losses]) * chunk.shape[0]
        regression, cross_entropy, agreement = (totals / windows.shape[0]).tolist()
        results[f"heldout_regression_{name}"] = round(regression, 4)
        results[f"heldout_cross_entropy_{name}"] = round(cross_entropy, 4)
        results[f"heldout_top1_agreement_{name}"] = round(agreement, 4)
    return results


def save_head(head: EagleHead, config: LlamaConfig, out: Path) -> None:
    """config.json and model.safetensors (float16), named as published EAGLE heads are."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = {
        name: tensor.detach().to(torch.float16).contiguous()
        for name, tensor in head.state_dict().items()
        if not name.startswith("rotary.")
    }
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    raw = config.to_dict()
    raw.pop("_attn_implementation", None)
    raw["torch_dtype"] = raw["dtype"] = "float16"
    raw["bias"] = True  # EAGLE-1's flag for fc's bias
    write_json(out / "config.json", raw)
    for path in out.iterdir():
        path.chmod(0o644)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=Path, default=DEMO / "target")
    parser.add_argument("--out", type=Path, default=DEMO / "eagle")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--cls-weight", type=float, default=0.1)
    parser.add_argument("--noise", type=float, default=0.1)
    parser.add_argument("--unroll", type=int, default=2)
    parser.add_argument("--eval-windows", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    corpus = load_corpus(stdlib_dir())
    tokenizer = Tokenizer.from_file(str(args.target / "tokenizer.json"))
    train_data = encode_files(tokenizer, [text for _, text in corpus.train])
    heldout = encode_files(tokenizer, [text for _, text in corpus.heldout])
    target = LlamaForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    target.requires_grad_(False)
    config = head_config(target.config)
    torch.manual_seed(args.seed)
    head = EagleHead(config).float().train()
    spec = TrainSpec(
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        min_lr_ratio=0.1,
        warmup_frac=0.05,
        weight_decay=0.0,
        grad_clip=1.0,
        seed=args.seed,
    )
    print(f"[eagle] {count_params(head):,} parameters, {spec.steps} steps", flush=True)
    wall = train(head, target, spec, train_data, args)
    results = evaluate(head, target, heldout, args)
    print(f"[eagle] {results}, trained in {wall:.1f}s", flush=True)
    save_head(head, config, args.out)
    report_path = args.out.parent / "TRAINING.json"
    report: dict[str, Any] = json.loads(report_path.read_text()) if report_path.exists() else {}
    report["eagle"] = {
        "target": str(args.target.name),
        "training": asdict(spec),
        "noise": args.noise,
        "cls_weight": args.cls_weight,
        "unroll": args.unroll,
        "parameters": count_params(head),
        "train_wall_time_s": round(wall, 1),
        "last_run_wall_time_s": round(time.perf_counter() - started, 1),
        "tokens_seen": spec.steps * spec.batch_size * spec.seq_len,
        **results,
    }
    write_json(report_path, report)


if __name__ == "__main__":
    main()
