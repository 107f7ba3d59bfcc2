"""Proposers by ``EngineConfig.speculative_method`` name."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from updraft.config import EngineConfig
from updraft.runner.runner import Runner
from updraft.speculative.draft_model import DraftModel
from updraft.speculative.eagle import eagle_proposer
from updraft.speculative.mtp import mtp_proposer
from updraft.speculative.ngram import NgramProposer
from updraft.speculative.proposer import Proposer


@dataclass(frozen=True)
class ProposerContext:
    """What a proposer may be built from."""

    config: EngineConfig
    target: Runner  # the target's runner: its model config, block count, generator
    max_model_len: int


ProposerFactory = Callable[[ProposerContext], Proposer]

PROPOSERS: dict[str, ProposerFactory] = {
    "draft": lambda context: DraftModel(
        context.config,
        context.target.model_config,
        context.target.num_blocks,
        context.max_model_len,
        context.target.generator,
    ),
    "ngram": lambda context: NgramProposer(context.config.num_speculative_tokens),
    "mtp": lambda context: mtp_proposer(
        context.target, context.config.model, context.config.num_speculative_tokens
    ),
    "eagle": lambda context: eagle_proposer(
        context.target, context.config.speculative_model, context.config.num_speculative_tokens
    ),
}


def register_proposer(method: str, factory: ProposerFactory) -> None:
    """Make ``speculative_method=method`` build its proposer with ``factory``."""
    PROPOSERS[method] = factory


def check_method(method: str | None) -> None:
    if method is not None and method not in PROPOSERS:
        raise ValueError(
            f"speculative_method must be one of {', '.join(sorted(PROPOSERS))}, got {method!r}"
        )


def make_proposer(context: ProposerContext) -> Proposer | None:
    method = context.config.speculative_method
    check_method(method)
    return None if method is None else PROPOSERS[method](context)
