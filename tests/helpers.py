"""What many tests build their runs from: greedy sampling, prompts of token ids, the
tokens of outputs."""

from __future__ import annotations

import random
from typing import Any

import torch

from updraft import RequestOutput, SamplingParams
from updraft.step.inputs import ForwardInputs


def greedy(max_tokens: int = 16, **params: Any) -> SamplingParams:
    """Greedy decoding of exactly ``max_tokens`` tokens (EOS ignored, unless told)."""
    return SamplingParams(temperature=0, max_tokens=max_tokens, **{"ignore_eos": True, **params})


def token_prompts(count: int, seed: int = 0) -> list[list[int]]:
    """``count`` prompts of 3 to 40 random token ids below 256 (the tiny models' vocab)."""
    rng = random.Random(seed)
    return [[rng.randrange(1, 256) for _ in range(rng.randint(3, 40))] for _ in range(count)]


def token_ids(outputs: list[RequestOutput]) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in outputs]


def generate_logits(model: Any, prompt: list[int], new_tokens: int) -> tuple[list[int], Any]:
    """transformers' greedy ``generate`` with its cache: the prompt in one forward, then
    a token at a time (so LongRoPE switches as the sequence grows, as it does there), its
    ``new_tokens`` tokens and the logits of each."""
    import torch

    with torch.no_grad():
        out = model.eval().generate(
            torch.tensor([prompt]),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences[0, len(prompt) :].tolist(), torch.cat(out.logits)


def own_block_inputs(
    queries: list[tuple[int, int, list[int]]], block: int, blocks_per_request: int
) -> ForwardInputs:
    """One step's inputs for ``queries`` (request, first position, tokens), request r on
    blocks of its own: [r * blocks_per_request, (r + 1) * blocks_per_request)."""
    ids, positions, slots, seq_lens, starts = [], [], [], [], [0]
    for request, start, tokens in queries:
        ids += tokens
        span = range(start, start + len(tokens))
        positions += span
        slots += [request * blocks_per_request * block + p for p in span]
        seq_lens.append(start + len(tokens))
        starts.append(starts[-1] + len(tokens))
    first = [request * blocks_per_request for request, _, _ in queries]
    return ForwardInputs(
        input_ids=torch.tensor(ids),
        positions=torch.tensor(positions),
        slot_mapping=torch.tensor(slots),
        block_table=torch.tensor([list(range(f, f + blocks_per_request)) for f in first]),
        seq_lens=torch.tensor(seq_lens),
        query_start_loc=torch.tensor(starts),
    )


def recorded_proposals(patch: Any, proposer: type) -> list[tuple[list[int], list[int]]]:
    """Every proposal ``proposer`` makes while ``patch`` (a monkeypatch context) lasts:
    (the tokens it was made from, its drafts), in order."""
    proposals = []
    propose = proposer.propose

    def spy(self, inputs, output, drafting):
        drafts = propose(self, inputs, output, drafting)
        for request, _ in drafting:
            if request.request_id in drafts:
                proposals.append((list(request.token_ids), drafts[request.request_id].token_ids))
        return drafts

    patch.setattr(proposer, "propose", spy)
    return proposals


# Three sequences as a verify step makes them: queries of 4, 2 and 3 tokens (the last a
# whole short prompt) over contexts of 9, 14 and 3 positions.
SHORT_QUERY_LENS, SHORT_SEQ_LENS = (4, 2, 3), (9, 14, 3)


def short_query_metadata(block_table: torch.Tensor, block_size: int) -> Any:
    """The attention metadata of those three sequences, in one group, over ``block_table``
    ([3, blocks]); the slot mapping is unused by reads."""
    from updraft.attention.metadata import AttentionMetadata, GroupShape

    tokens = sum(SHORT_QUERY_LENS)
    starts = [0, *torch.tensor(SHORT_QUERY_LENS).cumsum(0).tolist()]
    shape = GroupShape(
        0, 3, 0, tokens, max_query=max(SHORT_QUERY_LENS), max_context=max(SHORT_SEQ_LENS)
    )
    return AttentionMetadata(
        slot_mapping=torch.zeros(tokens, dtype=torch.long),
        block_table=block_table,
        seq_lens=torch.tensor(SHORT_SEQ_LENS),
        query_start_loc=torch.tensor(starts),
        shapes=(shape,),
        positions_per_block=block_size,
    )
