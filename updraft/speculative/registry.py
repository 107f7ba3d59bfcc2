"""Proposers by ``EngineConfig.speculative_method`` name."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from updraft.config import EngineConfig
from updraft.models.draft_head import eagle_head, mtp_head
from updraft.runner.runner import Runner
from updraft.speculative.draft_model import DraftModel
from updraft.speculative.head import HeadProposer
from updraft.speculative.ngram import NgramProposer
from updraft.speculative.proposer import Proposer


@dataclass(frozen=True)
class ProposerContext:
    """What a proposer may be built from."""

    config: EngineConfig
    target: Runner  # the target's runner: its model config, block count, generator
    max_model_len: int


ProposerFactory = Callable[[ProposerContext], Proposer]


def head_proposer(make_head: Callable, head_dir: Callable[[EngineConfig], str]) -> ProposerFactory:
    """A factory of a draft head's proposer: ``make_head(target model, its config, the
    head's directory, dtype, device)`` -> (head, the head's config)."""

    def factory(context: ProposerContext) -> HeadProposer:
        target = context.target
        head, head_config = make_head(
            target.model,
            target.model_config,
            head_dir(context.config),
            target.dtype,
            target.device,
        )
        return HeadProposer(target, head, head_config, context.config.num_speculative_tokens)

    return factory


PROPOSERS: dict[str, ProposerFactory] = {
    "draft": lambda context: DraftModel(
        context.config,
        context.target.model_config,
        context.target.num_blocks,
        context.max_model_len,
        context.target.generator,
    ),
    "ngram": lambda context: NgramProposer(context.config.num_speculative_tokens),
    # MTP layers live in the target's own checkpoint; an EAGLE head in a directory of
    # its own.
    "mtp": head_proposer(mtp_head, lambda config: config.model),
    "eagle": head_proposer(eagle_head, lambda config: config.speculative_model),
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
