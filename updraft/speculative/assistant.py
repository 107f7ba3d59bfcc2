"""Drafting with Gemma 4's assistant (``models/gemma4_assistant.py``), as transformers'
``SinglePositionMultiTokenCandidateGenerator`` drafts with it.

After a target step, a request with n tokens drafts at one position, n - 1 (its newest
token's), for every draft: step 0 reads the newest token beside the target's final
hidden state at its last accepted row (position n - 2), step d the draft of step d - 1
beside the assistant's own projected state. Every step attends over the target's K/V of
positions 0..n-2 in the target's own cache (its store layers' tensors, which the
assistant's runner holds as its caches), through the request's block table: the
declared ``block_table`` input of every step and loop, refreshed at each replay. The
assistant writes no K/V (slot -1 throughout), so the scheduler's lookahead slots stay
unused and a rejected draft leaves nothing behind; preemption recomputes the target's
K/V and the assistant keeps no state of its own.

transformers, after a rejection, also lets the assistant read the target's K/V at
position n - 1, where the target saw the rejected draft; here a draft reads only the
context the target has accepted.

Greedy batches draft in one replay of the runner's draft loop (``assistant_drafts``);
others draft step by step (``draft_token_by_token``), sampled like any proposer's.
"""

from __future__ import annotations

from dataclasses import replace
from typing import ClassVar

import torch

from updraft.attention.kv_int8 import kv_head_dim
from updraft.attention.metadata import AttentionMetadata, ContextSplit
from updraft.config import EngineConfig
from updraft.model_config import ModelConfig
from updraft.models.gemma4_assistant import Gemma4Assistant, load_assistant
from updraft.request import Request
from updraft.runner.draft_loop import DraftLoopInputs
from updraft.runner.runner import Runner
from updraft.speculative.head import last_accepted_rows
from updraft.speculative.proposer import draft_token_by_token
from updraft.step.inputs import HEAD_GRAPH_INPUTS, StepInputs, block_table_of
from updraft.step.output import StepOutput
from updraft.step.plan import Draft


def context_lengths(positions: torch.Tensor) -> torch.Tensor:
    """How many of the target's positions a draft at ``positions`` reads: those before
    it, all of which the target has accepted (its own K/V at the draft's position is
    not the newest token's yet)."""
    return positions


def assistant_drafts(
    assistant: Gemma4Assistant,
    kv_caches: list[torch.Tensor],
    inputs: DraftLoopInputs,
    depth: int,
    positions_per_block: int,
    context: ContextSplit,
) -> torch.Tensor:
    """Every request's ``depth`` greedy drafts [requests, depth]: ``depth`` assistant
    steps, each at the request's position ``inputs.positions`` over its ``positions``
    positions of context; ``input_ids`` is the newest token, not a draft."""
    metadata = AttentionMetadata.bucket(
        positions_per_block,
        slot_mapping=torch.full_like(inputs.positions, -1),
        block_table=inputs.block_table,
        seq_lens=context_lengths(inputs.positions),  # padded rows: position 0, none
        query_start_loc=inputs.query_start_loc,
        num_requests=inputs.num_reqs,
        query_len=1,
        context=context,
    )
    tokens, state, drafts = inputs.input_ids, inputs.hidden_states, []
    for _ in range(depth):
        output = assistant(tokens, inputs.positions, kv_caches, metadata, hidden_states=state)
        tokens = assistant.compute_logits(output).argmax(dim=-1)
        state = assistant.next_states(output)
        drafts.append(tokens)
    return torch.stack(drafts, dim=1)


def assistant_runner(config: EngineConfig, target: Runner, num_speculative_tokens: int) -> Runner:
    """The assistant in ``config.speculative_model`` over ``target``'s model and caches,
    in a runner of its own: decode-shaped steps and the greedy loop captured where the
    target has graphs, nothing allocated."""
    if target.place is not None and target.place.sizes.world > 1:
        raise ValueError(
            "the Gemma 4 assistant runs in one process: it reads the target's whole "
            "hidden states and K/V heads (tensor and context parallelism are not supported)"
        )
    target_config = target.model_config
    store = target_config.kv_store_layers()
    assistant = load_assistant(
        config.speculative_model,
        target.model,
        store,
        target.dtype,
        target.device,
        target.max_model_len,
        config.weight_format(target_config),
    )
    check_assistant(assistant, target_config, target.kv_caches, config.speculative_model)
    eager = config.enforce_eager or bool(config.speculative_enforce_eager)
    return Runner(
        assistant,
        target_config,
        replace(config, enforce_eager=eager, capture_tokens=()),
        target.max_model_len,
        dtype=target.dtype,
        name="assistant",
        num_blocks=target.num_blocks,
        inputs=HEAD_GRAPH_INPUTS,
        draft_loop_depth=num_speculative_tokens,
        draft_loop=assistant_drafts,
        kv_caches=target.kv_caches,
    )


def check_assistant(
    assistant: Gemma4Assistant,
    target: ModelConfig,
    caches: list[torch.Tensor],
    where: str,
) -> None:
    """What the assistant reads of the target fits it: its width, vocabulary, and per
    layer kind the head size and KV heads of the target's cache it attends over."""
    config = assistant.weights.config
    for name, mine, theirs in (
        ("backbone_hidden_size", config.backbone_hidden_size, target.hidden_size),
        ("vocab_size", config.vocab_size, target.vocab_size),
    ):
        if mine != theirs:
            raise ValueError(
                f"Gemma 4 assistant {where} has {name} {mine}, its target {theirs}: it reads "
                "the target's hidden states and embedding"
            )
    missing = set(config.layer_types) - set(assistant.store_layers)
    if missing:
        raise ValueError(
            f"Gemma 4 assistant {where} has {sorted(missing)} layers, which its target "
            f"({target.architecture}) has none of to read K/V from"
        )
    for layer, (kind, head_dim) in enumerate(
        zip(config.layer_types, config.head_dims, strict=True)
    ):
        cache = caches[assistant.store_layers[kind]]
        kv_heads, cache_dim = cache.shape[-2], kv_head_dim(cache)
        if cache_dim != head_dim or config.num_heads % kv_heads:
            raise ValueError(
                f"Gemma 4 assistant {where}: layer {layer} ({kind}) has {config.num_heads} "
                f"heads of {head_dim}, the target's {kind} K/V {kv_heads} heads of {cache_dim}"
            )


class AssistantProposer:
    wants_hidden_states: ClassVar[bool] = True

    def __init__(self, target: Runner, runner: Runner) -> None:
        """``runner``: the assistant's (``assistant_runner``)."""
        self.target = target
        self.runner = runner

    @torch.inference_mode()
    def propose(
        self, inputs: StepInputs, output: StepOutput, drafting: list[tuple[Request, int]]
    ) -> dict[str, Draft]:
        last_rows = last_accepted_rows(inputs, output)
        chosen = [(r, limit) for r, limit in drafting if limit and r.request_id in last_rows]
        if not chosen:
            return {}
        rows = torch.tensor([last_rows[r.request_id] for r, _ in chosen])
        states = output.hidden_states.index_select(0, rows.to(output.hidden_states.device))
        if self.runner.fits_draft_loop(len(chosen)) and all(
            request.sampling_params.greedy for request, _ in chosen
        ):
            return self._loop_drafts(chosen, states)
        state_rows = list(range(len(chosen)))

        def logits_of(step: StepInputs, rows: list[int]) -> torch.Tensor:
            nonlocal states, state_rows
            if len(rows) < len(state_rows):  # the batch shrank: drop finished requests
                keep = torch.tensor([state_rows.index(i) for i in rows], device=states.device)
                states = states.index_select(0, keep)
            position = torch.tensor([chosen[i][0].num_tokens - 1 for i in rows])
            forward = replace(
                step.forward,
                positions=position,
                seq_lens=context_lengths(position),
                slot_mapping=torch.full_like(position, -1),
                hidden_states=states,
            )
            result = self.runner.forward(replace(step, forward=forward, return_hidden_states=True))
            states, state_rows = self.runner.model.next_states(result.hidden_states), rows
            return result.logits

        return draft_token_by_token(
            chosen,
            lambda request: request.num_tokens - 1,
            logits_of,
            self.runner.positions_per_block,
            self.target.generator,
        )

    def _loop_drafts(
        self, chosen: list[tuple[Request, int]], states: torch.Tensor
    ) -> dict[str, Draft]:
        requests = [request for request, _ in chosen]
        limits = [limit for _, limit in chosen]
        drafts = self.runner.draft_loop(
            DraftLoopInputs(
                input_ids=torch.tensor([r.token_ids[-1] for r in requests]),
                positions=torch.tensor([r.num_tokens - 1 for r in requests]),
                block_table=block_table_of([r.block_ids for r in requests]),
                query_start_loc=torch.arange(len(requests) + 1),
                draft_limits=torch.tensor(limits),
                hidden_states=states,
            ),
            [request.request_id for request in requests],
        )
        return {
            request.request_id: Draft(tokens[:limit], None)
            for request, limit, tokens in zip(requests, limits, drafts.tolist(), strict=True)
        }
