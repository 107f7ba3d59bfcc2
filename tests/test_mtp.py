"""DeepSeek's multi-token prediction layer against transformers' ``MtpModel``: a tiny
DeepSeek-V3 checkpoint carrying one MTP layer in DeepSeek's layout
(``model.layers.{num_hidden_layers}.*``), loaded by both."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.modeling_layers import MtpModel

from tests.conftest import DEEPSEEK_TINY
from tests.probes import DRAFT_LOOP_MUTATIONS, forget_refresh, recorded_speculative_run
from updraft import LLM, SamplingParams
from updraft.attention.cache_layout import cache_layout
from updraft.attention.metadata import AttentionMetadata, GroupShape
from updraft.config import ModelConfig
from updraft.models.loader import load_model
from updraft.models.mtp import load_mtp_layers


def mtp_checkpoint(directory: Path) -> Path:
    """Save a tiny V3 main model, then write a random MTP layer beside it under the
    names DeepSeek's checkpoints use: the block's tensors at the layer's top level,
    ``shared_head.norm`` for the output norm, one tensor per expert."""
    config = transformers.DeepseekV3Config(
        **DEEPSEEK_TINY, q_lora_rank=16, num_nextn_predict_layers=1
    )
    torch.manual_seed(0)
    main = transformers.DeepseekV3ForCausalLM(config).eval()
    main.save_pretrained(directory)
    mtp = MtpModel(main, 1)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, tensor in mtp.named_parameters():
            if name.startswith("layers.0."):
                tensor.normal_(0, 0.2)
        for name, tensor in mtp.named_buffers():
            if name.endswith("e_score_correction_bias"):
                tensor.normal_(0, 0.5)
    layer = config.num_hidden_layers
    tensors = load_file(directory / "model.safetensors")
    for name, tensor in mtp.state_dict().items():
        if not name.startswith("layers.0."):
            continue
        rest = name.removeprefix("layers.0.").replace("mtp_block.", "")
        rest = rest.replace("post_norm.", "shared_head.norm.")
        prefix = f"model.layers.{layer}."
        if rest.endswith("experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)
            for expert in range(tensor.shape[0]):
                tensors[f"{prefix}mlp.experts.{expert}.gate_proj.weight"] = gate[expert].clone()
                tensors[f"{prefix}mlp.experts.{expert}.up_proj.weight"] = up[expert].clone()
        elif rest.endswith("experts.down_proj"):
            for expert in range(tensor.shape[0]):
                tensors[f"{prefix}mlp.experts.{expert}.down_proj.weight"] = tensor[expert].clone()
        else:
            tensors[prefix + rest] = tensor.clone().contiguous()
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return mtp_checkpoint(tmp_path_factory.mktemp("deepseek-mtp"))


def reference(model_dir: Path, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers: the main model's final hidden states at positions 0..T-2, and the
    MTP layer's logits there, fed the tokens at 1..T-1."""
    main = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    layer = main.config.num_hidden_layers
    # transformers looks for DeepSeek-V3's own MTP layer index (61); this model has 3.
    main._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{layer}\..*"]
    mtp = MtpModel.from_pretrained(main).eval()
    ids = torch.tensor([tokens])
    with torch.no_grad():
        hidden = main.eval().model(ids[:, :-1]).last_hidden_state
        positions = torch.arange(1, len(tokens))[None]
        out = mtp.forward_layer(0, hidden, positions, None, input_ids=ids[:, 1:])
        return hidden[0], mtp._project_to_logits(out)[0]


@torch.inference_mode()
def test_the_mtp_layer_matches_transformers_over_a_prefill_and_a_decode(checkpoint):
    tokens = list(range(30, 50))
    hidden, expected = reference(checkpoint, tokens)
    config = ModelConfig.from_dir(checkpoint)
    main = load_model(config, checkpoint, torch.float32)
    (depth,) = load_mtp_layers(config, checkpoint, torch.float32, "cpu").depths()
    block_size, num_blocks = 4, 8
    cache = torch.zeros(cache_layout(config).shape(num_blocks * block_size + 1))
    block_table = torch.arange(num_blocks)[None]
    count = len(tokens) - 1  # MTP positions: the main model's 0..T-2, next tokens 1..T-1
    embeds = main.model.embed_tokens(torch.tensor(tokens[1:]))
    got = []
    # The first count - 1 positions as one prefill chunk (expanded attention), the last
    # as a decode (absorbed attention over the layer's latent cache).
    for first, last in ((0, count - 1), (count - 1, count)):
        rows = last - first
        metadata = AttentionMetadata(
            slot_mapping=torch.arange(first, last),
            block_table=block_table,
            seq_lens=torch.tensor([last]),
            query_start_loc=torch.tensor([0, rows]),
            shapes=[GroupShape(0, 1, 0, rows, rows, last)],
            positions_per_block=block_size,
        )
        rotary = main.rotary.lookup(torch.arange(first + 1, last + 1), torch.float32)
        out = depth(embeds[first:last], hidden[first:last], rotary, cache, metadata)
        got.append(main.compute_logits(out))
    torch.testing.assert_close(torch.cat(got), expected, atol=1e-4, rtol=0)


def test_the_engine_serves_the_main_model_of_a_checkpoint_with_mtp_layers(checkpoint):
    """The main model skips the MTP layer's tensors and equals transformers' greedy."""
    prompt = list(range(5, 17))
    got = LLM(checkpoint, block_size=4, num_kv_blocks=64).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    )[0]
    reference_model = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float32
    )
    expected = reference_model.generate(
        torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0
    )[0, len(prompt) :].tolist()
    assert got.outputs[0].token_ids == expected


def test_a_checkpoint_without_mtp_layers_says_so(tiny_deepseek):
    _, model_dir = tiny_deepseek
    config = ModelConfig.from_dir(model_dir)
    with pytest.raises(ValueError, match=r"num_nextn_predict_layers|missing"):
        load_mtp_layers(config, model_dir, torch.float32, "cpu")


def reference_mtp(model_dir: Path):
    main = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    layer = main.config.num_hidden_layers
    main._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{layer}\..*"]
    return main.eval(), MtpModel.from_pretrained(main).eval()


@torch.no_grad()
def reference_drafts(main, mtp, tokens: list[int], k: int) -> list[int]:
    """What the MTP layer drafts after ``tokens``, reused k times: entry n - 2 (the
    newest token beside the main model's last hidden state), then its own output
    chained with each draft, over the whole sequence at once."""
    ids = torch.tensor([tokens])
    hidden = main.model(ids[:, :-1]).last_hidden_state
    inputs = tokens[1:]
    drafts = []
    for _ in range(k):
        positions = torch.arange(1, len(inputs) + 1)[None]
        out = mtp.forward_layer(0, hidden, positions, None, input_ids=torch.tensor([inputs]))
        draft = int(mtp._project_to_logits(out[:, -1]).argmax())
        drafts.append(draft)
        hidden = torch.cat([hidden, out[:, -1:]], dim=1)
        inputs = [*inputs, draft]
    return drafts


def mtp_run(checkpoint, token_budget: int, prepare=None, **engine_args):
    """``recorded_speculative_run`` with the checkpoint's MTP layer."""
    return recorded_speculative_run(
        checkpoint, token_budget, prepare, speculative_method="mtp", **engine_args
    )


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
@pytest.mark.parametrize("token_budget", [1024, 12], ids=["whole-prefill", "chunked-prefill"])
def test_mtp_drafts_are_transformers_mtp_drafts_and_keep_greedy_output(
    checkpoint, token_budget, enforce_eager
):
    """Every proposal, at every step, equals the drafts transformers' MtpModel makes
    from the same tokens (so the layer's cache holds exactly what a full forward would
    compute); and greedy output with MTP speculation equals greedy output without.
    With graphs on, the MTP steps replay captured graphs."""
    plain, got, seen, proposer = mtp_run(checkpoint, token_budget, enforce_eager=enforce_eager)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    assert len(seen) > 10
    assert (proposer.step_modes["graph"] > 0) != enforce_eager, proposer.step_modes
    main, mtp = reference_mtp(checkpoint)
    for tokens, drafts in seen:
        assert drafts == reference_drafts(main, mtp, tokens, len(drafts)), len(tokens)


MUTATIONS = {
    **{
        name: forget_refresh(name)
        for name in ("hidden_states", "block_table", "slot_mapping", "positions", "seq_lens")
    },
    **DRAFT_LOOP_MUTATIONS,
}


@pytest.mark.parametrize("skip", [None, *MUTATIONS])
def test_an_mtp_graph_that_skips_a_refresh_leaves_another_cache(checkpoint, skip):
    """The target's hidden states are a declared input of the MTP graphs, refreshed at
    every replay like the block table, slots, positions and lengths. The MTP layer's
    latent cache after a run with graphs equals the eager run's; a replay that keeps
    any one input from an earlier step leaves other rows (or drafts other tokens), in
    the mirror's steps or the draft loop's."""
    _, _, eager_seen, eager = mtp_run(checkpoint, 1024, enforce_eager=True)
    prepare = None if skip is None else MUTATIONS[skip]
    _, _, seen, graphs = mtp_run(checkpoint, 1024, prepare=prepare)
    assert graphs.step_modes["graph"] > 0
    live = slice(0, -1)  # the spare last slot takes padded rows' writes
    difference = (graphs.caches[0][live] - eager.caches[0][live]).abs().max().item()
    if skip is None:
        assert difference < 1e-4 and seen == eager_seen
    else:
        assert difference > 1e-3 or seen != eager_seen, f"the {skip} refresh went unnoticed"


def test_a_mixed_batch_of_16_keeps_greedy_output_and_acceptance_with_graphs(checkpoint):
    """Greedy output with MTP equals greedy output without, eager and with graphs; and
    the acceptance per draft position with graphs equals eager's."""
    prompts = [list(range(10, 30)) + [i, i + 1] * (i % 3 + 1) for i in range(40, 56)]
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (20, 7, 13, 25) * 4
    ]
    args = dict(block_size=4, num_kv_blocks=512)
    plain = LLM(checkpoint, **args).generate(prompts, params)
    metrics = {}
    for enforce_eager in (True, False):
        llm = LLM(
            checkpoint,
            speculative_method="mtp",
            num_speculative_tokens=3,
            enforce_eager=enforce_eager,
            **args,
        )
        got = llm.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
        stats = llm.engine.stats()
        assert stats.speculative.rounds > 0 and stats.kv_blocks_used == 0
        assert ("graph" in stats.draft_steps) != enforce_eager, stats.draft_steps
        metrics[enforce_eager] = (stats.speculative.proposed, stats.speculative.accepted)
    assert metrics[True] == metrics[False]


def test_preemption_and_prefix_caching_keep_greedy_output_with_mtp(checkpoint):
    prompts = [list(range(10, 30)) + [i, i + 1] * (i % 3 + 1) for i in range(40, 52)]
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (30, 12, 22, 35) * 3
    ]
    plain = LLM(checkpoint, block_size=4, num_kv_blocks=512).generate(prompts, params)
    llm = LLM(
        checkpoint,
        block_size=4,
        num_kv_blocks=40,
        max_num_batched_tokens=24,
        speculative_method="mtp",
    )
    got = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    assert sum(o.metrics.num_preemptions for o in got) > 0
    assert llm.engine.stats().kv_blocks_used == 0


def test_mtp_on_a_model_without_mtp_layers_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="no multi-token prediction layers"):
        LLM(tiny_llama, speculative_method="mtp")
