"""Proposers by ``EngineConfig.speculative_method`` name."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from updraft.config import EngineConfig
from updraft.model_config import ModelConfig
from updraft.model_config.registry import ARCHITECTURES
from updraft.models.draft_head import eagle_head, mtp_head
from updraft.runner.rank_messages import Send
from updraft.runner.runner import Runner
from updraft.speculative.assistant import AssistantProposer, assistant_runner
from updraft.speculative.draft_model import DraftModel, draft_runner
from updraft.speculative.head import HeadProposer, head_runner
from updraft.speculative.ngram import NgramProposer
from updraft.speculative.proposer import Proposer


@dataclass(frozen=True)
class ProposerContext:
    """What a proposer may be built from."""

    config: EngineConfig
    target: Runner  # the target's runner: its model config, block count, generator
    max_model_len: int
    send: Send | None = None  # rank 0's announcer of a split model's forwards


ProposerFactory = Callable[[ProposerContext], Proposer]
ASSISTANT = "gemma4-assistant"
RunnerFactory = Callable[[ProposerContext], Runner]


def head_runner_factory(
    make_head: Callable, head_dir: Callable[[EngineConfig], str]
) -> RunnerFactory:
    """A factory of a draft head's runner: ``make_head(target model, its config, the
    head's directory, dtype, device, place, weight format)`` -> (head, the head's
    config); a head keeps its weights in the target's format."""

    def factory(context: ProposerContext) -> Runner:
        target = context.target
        head, head_config = make_head(
            target.model,
            target.model_config,
            head_dir(context.config),
            target.dtype,
            target.device,
            target.place,
            context.config.weight_format(target.model_config),
        )
        k = context.config.num_speculative_tokens
        return head_runner(target, head, head_config, k, context.send)

    return factory


def draft_model_runner(context: ProposerContext) -> Runner:
    return draft_runner(context.config, context.target, context.max_model_len, context.send)


# The runner each proposer's model runs in. Those of draft heads run on every rank of a
# split target, as does a draft model's with draft_tensor_parallel_size > 1: each rank
# builds one (engine/workers.py).
RUNNERS: dict[str, RunnerFactory] = {
    # MTP layers live in the target's own checkpoint; an EAGLE head in a directory of
    # its own.
    "mtp": head_runner_factory(mtp_head, lambda config: config.model),
    "eagle": head_runner_factory(eagle_head, lambda config: config.speculative_model),
    "draft": draft_model_runner,
}

PROPOSERS: dict[str, ProposerFactory] = {
    "draft": lambda context: DraftModel(
        draft_model_runner(context),
        context.config.positions_per_block,
        context.target.generator,
    ),
    "ngram": lambda context: NgramProposer(context.config.num_speculative_tokens),
    "mtp": lambda context: HeadProposer(context.target, RUNNERS["mtp"](context)),
    "eagle": lambda context: HeadProposer(context.target, RUNNERS["eagle"](context)),
    # Gemma 4's assistant drafter: the target's hidden states and K/V, one process.
    ASSISTANT: lambda context: AssistantProposer(
        context.target,
        assistant_runner(context.config, context.target, context.config.num_speculative_tokens),
    ),
}


def method_of(config: EngineConfig) -> str | None:
    """The proposer ``config`` asks for: its ``speculative_method``, where a draft
    model's checkpoint whose architecture has a proposer of its own (a drafter that
    reads its target, such as Gemma 4's assistant) is served by that proposer."""
    method = config.speculative_method
    if method == "draft" and config.speculative_model is not None:
        architecture = ModelConfig.from_dir(config.speculative_model).architecture
        return ARCHITECTURES[architecture].proposer or method
    if method == ASSISTANT and config.speculative_model is None:
        raise ValueError(
            f"speculative_method {ASSISTANT!r} needs speculative_model (the assistant's "
            "checkpoint directory)"
        )
    return method


def rank_runners(context: ProposerContext) -> list[Runner]:
    """The runners of the proposer's model that a rank other than 0 runs."""
    method = method_of(context.config)
    if method not in RUNNERS or (
        method == "draft" and context.config.draft_tensor_parallel_size == 1
    ):
        return []
    return [RUNNERS[method](context)]


def register_proposer(method: str, factory: ProposerFactory) -> None:
    """Make ``speculative_method=method`` build its proposer with ``factory`` (whose
    model, if any, runs on rank 0 alone)."""
    RUNNERS.pop(method, None)
    PROPOSERS[method] = factory


def check_method(method: str | None) -> None:
    if method is not None and method not in PROPOSERS:
        raise ValueError(
            f"speculative_method must be one of {', '.join(sorted(PROPOSERS))}, got {method!r}"
        )


def make_proposer(context: ProposerContext) -> Proposer | None:
    check_method(context.config.speculative_method)
    method = method_of(context.config)
    return None if method is None else PROPOSERS[method](context)
