"""A draft model: a smaller checkpoint with the same tokenizer and its own KV cache.

Its cache is separate tensors addressed by the same block ids and slots as the target's,
so it needs no bookkeeping of its own. Two kinds of draft step keep it right:

* the mirror step runs on the target's own ``StepInputs`` (same tokens, positions,
  slots and block table) after every target step, so the draft's KV follows the
  target's: prompts, prefill chunks and verified tokens alike;
* draft steps 1..k then decode one token per request from the newest known token, each
  built from the requests' current state, with positions, slots and seq_lens advancing
  by one. Their slots lie in the lookahead blocks the scheduler reserved.

Each of those steps replays a captured graph through ``graph.replay(inputs)`` when it
fits a bucket, so it is filled from that very step and from no buffer of another.
"""

from __future__ import annotations

from dataclasses import replace
from typing import ClassVar

import torch

from updraft.config import EngineConfig
from updraft.model_config import ModelConfig
from updraft.models.tensor_parallel import check_parallel
from updraft.request import Request
from updraft.runner.rank_messages import Send
from updraft.runner.runner import Runner, load_runner
from updraft.speculative.proposer import draft_token_by_token
from updraft.step.inputs import StepInputs
from updraft.step.output import StepOutput
from updraft.step.plan import Draft


def draft_runner(
    config: EngineConfig, target: Runner, max_model_len: int, send: Send | None = None
) -> Runner:
    """The draft model's runner: whole on rank 0 (``draft_tensor_parallel_size`` 1), or
    on every rank beside ``target``'s, split over the tensor ranks like the target and
    running every prefill whole on each prefill-context rank (``send``: rank 0's
    announcer of its forwards)."""
    if config.speculative_model is None:
        raise ValueError("the draft-model proposer needs speculative_model")
    model_config = ModelConfig.from_dir(config.speculative_model)
    if model_config.vocab_size != target.model_config.vocab_size:
        raise ValueError(
            f"speculative_model {config.speculative_model} has a vocabulary of "
            f"{model_config.vocab_size} tokens, the target {target.model_config.vocab_size}; "
            "a draft model must share the target's tokenizer"
        )
    eager = (
        config.enforce_eager
        if config.speculative_enforce_eager is None
        else config.speculative_enforce_eager
    )
    draft_config = replace(config, model=config.speculative_model, enforce_eager=eager)
    place = None
    if config.draft_tensor_parallel_size > 1:
        check_parallel(model_config, config.parallel_sizes, config.weight_format(model_config))
        place = target.place
    else:
        # Whole on rank 0, over the global step: its cache keeps every position of a
        # block, however the target's ranks split them, so its slots per block are the
        # target's positions per block.
        send = None
        draft_config = replace(
            draft_config,
            block_size=config.positions_per_block,
            tensor_parallel_size=1,
            prefill_context_parallel_size=1,
            decode_context_parallel_size=1,
        )
    k = config.num_speculative_tokens
    return load_runner(
        model_config,
        draft_config,
        max_model_len,
        name="draft",
        query_lens=(1, 1 + k),
        num_blocks=target.num_blocks,
        num_state_slots=target.num_state_slots,
        place=place,
        splits_prefills=False,
        send=send,
    )


class DraftModel:
    wants_hidden_states: ClassVar[bool] = False

    def __init__(self, runner: Runner, positions_per_block: int, generator: torch.Generator):
        """``runner``: the draft's (``draft_runner``); ``generator``: the target's."""
        self.runner = runner
        self.positions_per_block = positions_per_block
        self.generator = generator

    @torch.inference_mode()
    def propose(
        self, inputs: StepInputs, output: StepOutput, drafting: list[tuple[Request, int]]
    ) -> dict[str, Draft]:
        self.runner.forward(replace(inputs, return_hidden_states=False))  # the mirror step
        return draft_token_by_token(
            drafting,
            lambda request: request.num_tokens - 1,
            lambda step, rows: self.runner.forward(step).logits,
            self.positions_per_block,
            self.generator,
        )
