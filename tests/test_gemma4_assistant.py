"""Gemma 4's assistant drafter: a draft step's logits and next state equal transformers'
drafter given the same target state (its final hidden state and ``shared_kv_states``,
here read from a paged cache through scattered blocks), with the plain and the
centroid-masked head. Through the engine: every proposal is what transformers drafts
from the same tokens, greedy output equals no speculation's (graphs on and off, under
preemption), a graph replay that keeps a stale input drafts other tokens, an assistant
built to agree with its target has every draft accepted, and bad assistants are
refused by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from tests.checkpoints import GEMMA3_TEXT, build_checkpoint, gemma4_assistant, tiny_model
from tests.helpers import greedy, recorded_proposals, token_ids
from tests.mutations import (
    assistant_reads_one_on,
    assistant_state_from_the_row_before,
    forget_refresh,
)
from updraft import LLM, SamplingParams
from updraft.attention.metadata import AttentionMetadata
from updraft.model_config import ModelConfig
from updraft.models.gemma4_assistant import load_assistant
from updraft.runner.runner import Runner
from updraft.speculative.assistant import AssistantProposer
from updraft.step.inputs import ForwardInputs

BLOCK = 4


class TargetEmbedding(nn.Module):
    """What the assistant reads of its target: transformers' scaled embedding."""

    def __init__(self, target: nn.Module) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = target.model.embed_tokens
        self.embed = target.model.embed_tokens


@pytest.fixture(scope="module")
def hf_target() -> nn.Module:
    """The tiny gemma4 target: full layers with their own head size and one KV head
    whose values are their keys, proportional RoPE, a window shorter than the longer
    prompt, and KV shared by its last two layers (the store layers are 2 and 3)."""
    return tiny_model("gemma4")


def store_layers(target: nn.Module) -> dict[str, int]:
    config = target.config
    modes = config.kv_sharing_modes
    return {config.layer_types[i]: i for i, mode in enumerate(modes) if mode == "store"}


def paged(kv: tuple[torch.Tensor, torch.Tensor], blocks: list[int], cache: torch.Tensor) -> None:
    """One sequence's K/V [1, heads, n, dim] written into ``cache`` through ``blocks``."""
    for position in range(kv[0].shape[2]):
        slot = blocks[position // BLOCK] * BLOCK + position % BLOCK
        cache[0, slot], cache[1, slot] = kv[0][0, :, position], kv[1][0, :, position]


@pytest.mark.parametrize("ordered", [False, True], ids=["lm-head", "centroid-head"])
@torch.inference_mode()
def test_two_draft_steps_equal_transformers(hf_target, ordered, tmp_path):
    """Two requests (one longer than the window) in one batch, their target K/V in
    blocks out of order: each draft step's logits and next state equal transformers'
    drafter, fed as its candidate generator feeds it, within 1e-4."""
    directory = build_checkpoint(
        "gemma4-assistant", tmp_path / "assistant", seed=1, use_ordered_embeddings=ordered
    )
    import transformers

    reference = transformers.Gemma4AssistantForCausalLM.from_pretrained(directory).eval()
    store = store_layers(hf_target)
    assistant = load_assistant(
        directory, TargetEmbedding(hf_target), store, torch.float32, "cpu", 512
    )
    sequences = [list(range(40, 61)), [7, 3, 9, 12, 5, 77]]
    block_lists = [[5, 0, 3, 7, 1, 9], [2, 8]]
    caches: list[Any] = [None] * hf_target.config.num_hidden_layers
    states, expected = [], []
    for sequence, blocks in zip(sequences, block_lists, strict=True):
        context = torch.tensor([sequence[:-1]])
        out = hf_target(context, output_hidden_states=True, return_shared_kv_states=True)
        for kind, layer in store.items():
            k = out.shared_kv_states[kind][0]
            if caches[layer] is None:
                caches[layer] = torch.zeros(2, 10 * BLOCK + 1, k.shape[1], k.shape[3])
            paged(out.shared_kv_states[kind], blocks, caches[layer])
        state, token, steps = out.hidden_states[-1][:, -1:], torch.tensor([sequence[-1:]]), []
        states.append(state[0])
        for _ in range(2):  # as SinglePositionMultiTokenCandidateGenerator drafts
            embeds = torch.cat([hf_target.get_input_embeddings()(token), state], dim=-1)
            drafted = reference(
                inputs_embeds=embeds,
                position_ids=torch.tensor([[len(sequence) - 1]]),
                shared_kv_states=out.shared_kv_states,
            )
            token, state = drafted.logits.argmax(-1), drafted.last_hidden_state
            steps.append((drafted.logits[0, 0], state[0, 0], token[0, 0]))
        expected.append(steps)
    positions = torch.tensor([len(s) - 1 for s in sequences])
    step = ForwardInputs(
        input_ids=torch.tensor([s[-1] for s in sequences]),
        positions=positions,
        slot_mapping=torch.full((2,), -1),
        block_table=torch.tensor([blocks + [0] * (6 - len(blocks)) for blocks in block_lists]),
        seq_lens=positions,
        query_start_loc=torch.arange(3),
        hidden_states=torch.cat(states),
    )
    metadata = AttentionMetadata.from_step(step, BLOCK, "cpu")
    tokens, state = step.input_ids, step.hidden_states
    for depth in range(2):
        output = assistant(tokens, positions, caches, metadata, hidden_states=state)
        logits, state = assistant.compute_logits(output), assistant.next_states(output)
        for row, steps in enumerate(expected):
            want_logits, want_state, _ = steps[depth]
            torch.testing.assert_close(logits[row], want_logits, atol=1e-4, rtol=0)
            torch.testing.assert_close(state[row], want_state, atol=1e-4, rtol=0)
        tokens = torch.stack([steps[depth][2] for steps in expected])
        assert torch.equal(logits.argmax(-1), tokens)


# -- through the engine -------------------------------------------------------------------

PROMPTS = [list(range(10, 31)), [5, 6, 7] * 5, list(range(100, 137))]
PARAMS = [greedy(n) for n in (14, 9, 11)]
ENGINE = dict(block_size=BLOCK, num_kv_blocks=256, capture_sizes=(1, 4))


class Pair(NamedTuple):
    target: Path
    assistant: Path


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Pair:
    """The tiny gemma4 target and an assistant over its widths, random weights."""
    root = tmp_path_factory.mktemp("assistant-pair")
    target = build_checkpoint("gemma4", root / "target")
    return Pair(target, build_checkpoint("gemma4-assistant", root / "assistant", seed=1))


@pytest.fixture(scope="module")
def centroid_pair(pair, tmp_path_factory) -> Pair:
    """The same target, and an assistant with the centroid-masked head."""
    directory = tmp_path_factory.mktemp("centroid-assistant")
    assistant = build_checkpoint("gemma4-assistant", directory, seed=2, use_ordered_embeddings=True)
    return Pair(pair.target, assistant)


@pytest.fixture(scope="module")
def plain(pair) -> list[list[int]]:
    return token_ids(LLM(str(pair.target), **ENGINE).generate(PROMPTS, PARAMS))


class Run(NamedTuple):
    tokens: list[list[int]]
    proposals: list[tuple[list[int], list[int]]]  # (the tokens it was made from, drafts)
    stats: Any
    preemptions: int


def speculative_run(pair: Pair, monkeypatch, **args: Any) -> Run:
    """The greedy prompts with the assistant drafting 3 tokens, every proposal recorded."""
    with monkeypatch.context() as patch:
        proposals = recorded_proposals(patch, AssistantProposer)
        llm = LLM(
            str(pair.target),
            speculative_model=str(pair.assistant),
            num_speculative_tokens=3,
            **{**ENGINE, **args},
        )
        outputs = llm.generate(PROMPTS, PARAMS)
    stats = llm.engine.stats()
    assert stats.speculative.rounds > 0 and stats.kv_blocks_used == 0
    preemptions = sum(output.metrics.num_preemptions for output in outputs)
    return Run(token_ids(outputs), proposals, stats, preemptions)


class ReferenceDrafts:
    """transformers' drafts: the target over a sequence's tokens but its newest, then
    the assistant fed as ``SinglePositionMultiTokenCandidateGenerator`` feeds it."""

    def __init__(self, pair: Pair) -> None:
        import transformers

        self.target = transformers.Gemma4ForCausalLM.from_pretrained(pair.target).eval()
        self.assistant = transformers.Gemma4AssistantForCausalLM.from_pretrained(
            pair.assistant
        ).eval()

    @torch.inference_mode()
    def drafts(self, tokens: list[int], count: int) -> list[int]:
        context = torch.tensor([tokens[:-1]])
        out = self.target(context, output_hidden_states=True, return_shared_kv_states=True)
        state, token, drafts = out.hidden_states[-1][:, -1:], torch.tensor([tokens[-1:]]), []
        for _ in range(count):
            embeds = torch.cat([self.target.get_input_embeddings()(token), state], dim=-1)
            drafted = self.assistant(
                inputs_embeds=embeds,
                position_ids=torch.tensor([[len(tokens) - 1]]),
                shared_kv_states=out.shared_kv_states,
            )
            token, state = drafted.logits.argmax(-1), drafted.last_hidden_state
            drafts.append(int(token))
        return drafts


@pytest.fixture(scope="module")
def reference(pair) -> ReferenceDrafts:
    return ReferenceDrafts(pair)


def test_the_centroid_head_drafts_as_transformers_in_graphs(centroid_pair, plain, monkeypatch):
    """With the centroid-masked head (its top-k of clusters and scatter captured in the
    loop's graph), every proposal is transformers' and greedy output is kept."""
    run = speculative_run(centroid_pair, monkeypatch)
    assert run.tokens == plain and "graph" in run.stats.draft_steps
    reference = ReferenceDrafts(centroid_pair)
    for tokens, drafts in run.proposals:
        assert drafts == reference.drafts(tokens, len(drafts))


PROPOSAL_MUTATIONS = {
    "reads-one-on": assistant_reads_one_on,
    "state-row-before": assistant_state_from_the_row_before,
}


@pytest.mark.parametrize("mutation", ["loop", "steps", *PROPOSAL_MUTATIONS])
def test_every_proposal_is_transformers_drafts(pair, reference, mutation, monkeypatch):
    """Every proposal, by the captured greedy loop or step by step, equals what
    transformers drafts from the same tokens: the newest token at its position, the
    target's state before it, the target's K/V of every position before it. An
    assistant that also reads the K/V at its own position, or the state of the row
    before, drafts otherwise."""
    if mutation == "steps":
        monkeypatch.setattr(Runner, "fits_draft_loop", lambda self, num_reqs: False)
    elif mutation in PROPOSAL_MUTATIONS:
        PROPOSAL_MUTATIONS[mutation](monkeypatch)
    run = speculative_run(pair, monkeypatch)
    matches = [drafts == reference.drafts(tokens, len(drafts)) for tokens, drafts in run.proposals]
    assert all(matches) if mutation in ("loop", "steps") else not all(matches), mutation


@pytest.mark.parametrize(
    "args",
    [dict(enforce_eager=True), {}, dict(num_kv_blocks=14, max_num_batched_tokens=16)],
    ids=["eager", "graphs", "preempted"],
)
def test_greedy_output_equals_no_speculation(pair, plain, args, monkeypatch):
    """The assistant (its own proposer, picked by its architecture) keeps greedy output,
    eagerly, with its steps and loop replayed, and with requests preempted for blocks."""
    run = speculative_run(pair, monkeypatch, **args)
    assert run.tokens == plain
    assert len(run.proposals) > 10
    modes = run.stats.draft_steps
    assert ("graph" in modes) != bool(args.get("enforce_eager")), modes
    if "num_kv_blocks" in args:
        assert run.preemptions > 0


def test_sampled_requests_finish_and_repeat_with_a_seed(pair):
    """Sampled drafts (step by step, with their probabilities) are verified by the
    rejection sampler: requests finish, and a seed repeats them."""
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=12) for s in (1, 2, 3)]
    runs = []
    for _ in range(2):
        llm = LLM(str(pair.target), speculative_model=str(pair.assistant), **ENGINE)
        runs.append(token_ids(llm.generate(PROMPTS, params)))
        assert llm.engine.stats().speculative.rounds > 0
    assert runs[0] == runs[1] and all(len(tokens) == 12 for tokens in runs[0])


STEP_INPUTS = ("hidden_states", "block_table", "positions", "seq_lens")
LOOP_INPUTS = ("hidden_states", "block_table", "positions")
MUTATIONS = {
    **{f"step-{name}": ("assistant", name) for name in STEP_INPUTS},
    **{f"loop-{name}": ("assistant draft loop", name) for name in LOOP_INPUTS},
}


@pytest.fixture(scope="module")
def eager_proposals(pair) -> list:
    """Every proposal of an eager run (its drafts step by step, as the loop's are)."""
    with pytest.MonkeyPatch.context() as patch:
        return speculative_run(pair, patch, enforce_eager=True).proposals


@pytest.mark.parametrize("mutation", ["step", "loop", *MUTATIONS])
def test_a_stale_graph_input_drafts_other_tokens(pair, eager_proposals, mutation, monkeypatch):
    """With graphs, every proposal equals the eager run's, drafted step by step (as
    sampled requests are) or by the greedy loop; a replay that keeps its block table
    (the target's blocks it reads), hidden states, positions, lengths or tokens from an
    earlier step, in the step graphs or the loop's, drafts others."""
    path = mutation.partition("-")[0]
    if path == "step":  # no loop: each draft step replays a step graph
        monkeypatch.setattr(Runner, "fits_draft_loop", lambda self, num_reqs: False)
    if mutation in MUTATIONS:
        forget_refresh(monkeypatch, *reversed(MUTATIONS[mutation]))
    same = speculative_run(pair, monkeypatch).proposals == eager_proposals
    assert same if mutation not in MUTATIONS else not same, mutation


# -- an assistant that agrees with its target ---------------------------------------------


def agreeing_pair(root: Path) -> Pair:
    """A two-layer Gemma 3 target whose attention adds nothing (o_proj zero: its next
    token is a function of its newest token alone), and an assistant that computes
    that function: it reads only the embedding half of its input, its attention adds
    nothing either, and its MLPs, norms (Gemma 3's 1 + w as Gemma 4's w) and LM head
    are the target's. Its every draft is the target's greedy next token."""
    import transformers

    kinds = ["sliding_attention", "full_attention"]
    target = tiny_model("gemma3", num_hidden_layers=2, layer_types=kinds)
    config = transformers.Gemma4AssistantConfig(
        **gemma4_assistant(
            {**GEMMA3_TEXT, "num_hidden_layers": 2, "layer_types": kinds},
        )
    )
    config.text_config.hidden_size = GEMMA3_TEXT["hidden_size"]
    config.text_config.intermediate_size = GEMMA3_TEXT["intermediate_size"]
    assistant = transformers.Gemma4AssistantForCausalLM(config).eval()
    size = config.text_config.hidden_size
    with torch.no_grad():
        projection = assistant.pre_projection.weight
        projection.zero_()
        projection[:, :size] = torch.eye(size)
        for mine, theirs in zip(assistant.model.layers, target.model.layers, strict=True):
            theirs.self_attn.o_proj.weight.zero_()
            mine.self_attn.o_proj.weight.zero_()
            mine.mlp.load_state_dict(theirs.mlp.state_dict())
            for norm in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
                getattr(mine, norm).weight.copy_(1 + getattr(theirs, norm).weight)
        assistant.model.norm.weight.copy_(1 + target.model.norm.weight)
        assistant.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
    target.save_pretrained(root / "target")
    assistant.save_pretrained(root / "assistant")
    return Pair(root / "target", root / "assistant")


def test_an_assistant_that_agrees_with_its_target_has_every_draft_accepted(tmp_path):
    """Its proposals line up with the target's next tokens (the newest token at its
    position, each draft fed back): every draft is accepted, graphs on and off, and
    greedy output is the target's."""
    pair = agreeing_pair(tmp_path)
    plain = token_ids(LLM(str(pair.target), **ENGINE).generate(PROMPTS, PARAMS))
    for enforce_eager in (True, False):
        llm = LLM(
            str(pair.target),
            speculative_model=str(pair.assistant),
            num_speculative_tokens=3,
            enforce_eager=enforce_eager,
            **ENGINE,
        )
        assert token_ids(llm.generate(PROMPTS, PARAMS)) == plain
        speculative = llm.engine.stats().speculative
        assert sum(speculative.proposed) > 20
        assert speculative.accepted == speculative.proposed


def test_bad_assistants_are_refused_by_name(pair, tmp_path):
    """An assistant for another width, one served as the model, a config transformers
    refuses, and a token order that misses a token: each a ValueError that names it."""
    narrow = build_checkpoint("gemma4-assistant", tmp_path / "narrow", backbone_hidden_size=32)
    with pytest.raises(ValueError, match="backbone_hidden_size 32, its target 64"):
        LLM(str(pair.target), speculative_model=str(narrow), enforce_eager=True, **ENGINE)
    with pytest.raises(ValueError, match="is a drafter that runs beside its target"):
        LLM(str(pair.assistant), enforce_eager=True, **ENGINE)
    raw = json.loads((pair.assistant / "config.json").read_text())
    raw["text_config"]["num_kv_shared_layers"] = 1
    with pytest.raises(ValueError, match=r"num_kv_shared_layers = num_hidden_layers = 2\), got 1"):
        ModelConfig.from_dict(raw)
    ordered = build_checkpoint(
        "gemma4-assistant", tmp_path / "ordered", use_ordered_embeddings=True
    )
    tensors = load_file(ordered / "model.safetensors")
    tensors["masked_embedding.token_ordering"][0] = 1  # token 0 in no cluster, 1 in two
    save_file(tensors, ordered / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="token_ordering must list each of the 256 token ids"):
        LLM(str(pair.target), speculative_model=str(ordered), enforce_eager=True, **ENGINE)


def test_a_published_shape_of_config_is_read_as_transformers_reads_it():
    """The E2B assistant's config as published (no per_layer_config: full layers take
    global_head_dim; num_kv_shared_layers given): head sizes per layer, the full
    layers' proportional RoPE, the centroid head's clusters."""
    from updraft.model_config.gemma4_assistant import assistant_config

    text = dict(
        hidden_size=256,
        intermediate_size=2048,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        global_head_dim=512,
        sliding_window=512,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        num_kv_shared_layers=4,
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0,
        vocab_size=262144,
        rope_parameters={
            "full_attention": {
                "partial_rotary_factor": 0.25,
                "rope_theta": 1e6,
                "rope_type": "proportional",
            },
            "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"},
        },
    )
    raw = dict(
        architectures=["Gemma4AssistantForCausalLM"],
        backbone_hidden_size=1536,
        num_centroids=2048,
        centroid_intermediate_top_k=32,
        use_ordered_embeddings=True,
        text_config=text,
    )
    config = assistant_config(raw)
    assert config.head_dims == (256, 256, 256, 512)
    assert config.rope["full_attention"].kind == "proportional"
    assert config.rope["full_attention"].proportion == 0.25
    assert config.rope["sliding_attention"].theta == 1e4
    assert config.tokens_per_centroid == 128 and config.backbone_hidden_size == 1536
    assert ModelConfig.from_dict(raw).layer_windows == (512, 512, 512, None)
