"""EAGLE-1 heads against a reference built here from transformers' ``LlamaDecoderLayer``
and the head's own tensors, on tiny random Llama and Qwen3 targets with random heads
saved in the layout EAGLE heads are published in; and the demo target with its shipped,
trained head."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from torch import nn
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from benchmarks.bench_speculative import code_prompts
from tests.conftest import make_tiny_checkpoint
from tests.probes import DRAFT_LOOP_MUTATIONS, forget_refresh, recorded_speculative_run
from updraft import LLM, SamplingParams
from updraft.attention.metadata import AttentionMetadata, GroupShape
from updraft.config import ModelConfig
from updraft.demo import DEMO_DRAFT_DIR, DEMO_EAGLE_DIR, DEMO_MODEL_DIR
from updraft.models.loader import load_model
from updraft.speculative.eagle import eagle_proposer
from updraft.tokenizer import Tokenizer


def eagle_head_checkpoint(directory: Path, target_dir: Path, seed: int = 1) -> Path:
    """A random one-layer EAGLE-1 head for ``target_dir``: fc with a bias, layer 0
    without an input norm, and a copy of an embedding (published heads carry one) that
    must not be read."""
    target = json.loads((target_dir / "config.json").read_text())
    config = transformers.LlamaConfig(
        hidden_size=target["hidden_size"],
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=target["vocab_size"],
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
    )
    torch.manual_seed(seed)
    layer = LlamaDecoderLayer(config, 0)
    fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=True)
    tensors = {"fc.weight": fc.weight, "fc.bias": fc.bias}
    for name, tensor in layer.state_dict().items():
        if name.startswith("input_layernorm."):
            continue
        if "layernorm" in name:
            tensor = 1 + 0.2 * torch.randn_like(tensor)
        tensors[f"layers.0.{name}"] = tensor
    tensors["embed_tokens.weight"] = torch.randn(config.vocab_size, config.hidden_size)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(
        {name: t.detach().contiguous() for name, t in tensors.items()},
        directory / "model.safetensors",
        metadata={"format": "pt"},
    )
    raw = config.to_dict()
    raw.update(architectures=["LlamaForCausalLM"], torch_dtype="float32", bias=True)
    (directory / "config.json").write_text(json.dumps(raw))
    return directory


def make_pair(kind: str, root: Path) -> tuple[Path, Path]:
    """(target, head) directories."""
    target = make_tiny_checkpoint(kind, root / "target")
    return target, eagle_head_checkpoint(root / "head", target)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def pair(request, tmp_path_factory) -> tuple[Path, Path]:
    return make_pair(request.param, tmp_path_factory.mktemp(f"eagle-{request.param}"))


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory) -> tuple[Path, Path]:
    return make_pair("llama", tmp_path_factory.mktemp("eagle-mutations"))


class ReferenceHead(nn.Module):
    """EAGLE-1 in transformers' own layer: fc, then LlamaDecoderLayer without its input
    norm, over a whole sequence with a causal mask, positions 0.., and the target's
    embedding and LM head."""

    def __init__(self, target: nn.Module, head_dir: Path) -> None:
        super().__init__()
        config = transformers.LlamaConfig.from_pretrained(head_dir)
        config._attn_implementation = "eager"
        tensors = load_file(head_dir / "model.safetensors")
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=True)
        self.fc.load_state_dict({"weight": tensors["fc.weight"], "bias": tensors["fc.bias"]})
        self.layer = LlamaDecoderLayer(config, 0)
        self.layer.input_layernorm = nn.Identity()
        prefix = "layers.0."
        self.layer.load_state_dict(
            {n.removeprefix(prefix): t for n, t in tensors.items() if n.startswith(prefix)}
        )
        self.rotary = LlamaRotaryEmbedding(config)
        self.target = target

    @torch.no_grad()
    def features(self, tokens: list[int]) -> torch.Tensor:
        """The target's final hidden states over ``tokens`` [1, T, H]."""
        return self.target.model(torch.tensor([tokens])).last_hidden_state

    @torch.no_grad()
    def forward(self, next_tokens: list[int], features: torch.Tensor) -> torch.Tensor:
        """Entries 0.. (token i + 1 beside feature i) -> the head's output [1, T, H]."""
        hidden = self.fc(
            torch.cat([self.target.model.embed_tokens(torch.tensor([next_tokens])), features], -1)
        )
        length = hidden.shape[1]
        positions = torch.arange(length)[None]
        mask = torch.full((length, length), float("-inf")).triu(1)[None, None]
        return self.layer(
            hidden,
            attention_mask=mask,
            position_ids=positions,
            position_embeddings=self.rotary(hidden, positions),
        )

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.lm_head(hidden)

    def drafts(self, tokens: list[int], k: int) -> list[int]:
        """What the head drafts after ``tokens``: entry n - 2 from the target's last
        feature, then its own output chained with each draft, over the whole sequence."""
        features = self.features(tokens[:-1])
        inputs = tokens[1:]
        drafts = []
        for _ in range(k):
            out = self(inputs, features)
            drafts.append(int(self.logits(out[:, -1]).argmax()))
            features = torch.cat([features, out[:, -1:]], dim=1)
            inputs = [*inputs, drafts[-1]]
        return drafts


def reference_for(target_dir: Path, head_dir: Path) -> ReferenceHead:
    target = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    return ReferenceHead(target.eval(), head_dir).eval()


@torch.inference_mode()
def test_the_head_matches_transformers_over_a_prefill_and_a_decode(pair):
    """EagleModel's output logits over a prefill chunk (gathered attention) and a decode
    (read in place from the head's cache) equal the reference's within 1e-4."""
    target_dir, head_dir = pair
    tokens = list(range(30, 50))
    reference = reference_for(target_dir, head_dir)
    features = reference.features(tokens[:-1])
    expected = reference.logits(reference(tokens[1:], features))[0]

    config = ModelConfig.from_dir(target_dir)
    runner = SimpleNamespace(  # what eagle_proposer reads of the target's runner
        model_config=config,
        model=load_model(config, target_dir, torch.float32),
        dtype=torch.float32,
        device="cpu",
        num_blocks=8,
        positions_per_block=4,
        captured=None,
    )
    proposer = eagle_proposer(runner, str(head_dir), 3)
    count = len(tokens) - 1
    block_table = torch.arange(8)[None]
    got = []
    for first, last in ((0, count - 1), (count - 1, count)):
        rows = last - first
        metadata = AttentionMetadata(
            slot_mapping=torch.arange(first, last),
            block_table=block_table,
            seq_lens=torch.tensor([last]),
            query_start_loc=torch.tensor([0, rows]),
            shapes=[GroupShape(0, 1, 0, rows, rows, last)],
            positions_per_block=4,
        )
        out = proposer.head(
            torch.tensor(tokens[first + 1 : last + 1]),
            torch.arange(first, last),
            proposer.caches,
            metadata,
            features[0, first:last],
        )
        got.append(proposer.head.compute_logits(out))
    torch.testing.assert_close(torch.cat(got), expected, atol=1e-4, rtol=0)


def eagle_run(target_dir, head_dir, token_budget: int, prepare=None, **engine_args):
    """``recorded_speculative_run`` with the head in ``head_dir``."""
    return recorded_speculative_run(
        target_dir,
        token_budget,
        prepare,
        speculative_method="eagle",
        speculative_model=str(head_dir),
        **engine_args,
    )


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
@pytest.mark.parametrize("token_budget", [1024, 12], ids=["whole-prefill", "chunked-prefill"])
def test_eagle_drafts_are_the_reference_drafts_and_keep_greedy_output(
    pair, token_budget, enforce_eager
):
    """Every proposal, at every step, equals the reference head's drafts from the same
    tokens over the whole sequence (so the head's cache holds what a full forward
    computes, prefill chunks included); greedy output equals greedy without EAGLE."""
    target_dir, head_dir = pair
    plain, got, seen, proposer = eagle_run(
        target_dir, head_dir, token_budget, enforce_eager=enforce_eager
    )
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    assert len(seen) > 10
    assert (proposer.step_modes["graph"] > 0) != enforce_eager, proposer.step_modes
    reference = reference_for(target_dir, head_dir)
    for tokens, drafts in seen:
        assert drafts == reference.drafts(tokens, len(drafts)), len(tokens)


def first_draft_from_the_row_before(proposer) -> None:
    """The first draft step reads the head's state one row before the request's newest
    entry (as a path that took the wrong row of the verify step would)."""
    mirror = proposer._mirror
    proposer._mirror = lambda *args: tuple(
        None if out is None else out.roll(1, 0) for out in mirror(*args)
    )


MUTATIONS = {
    "hidden_states": forget_refresh("hidden_states"),
    "block_table": forget_refresh("block_table"),
    "slot_mapping": forget_refresh("slot_mapping"),
    "positions": forget_refresh("positions"),
    "first-draft-row": first_draft_from_the_row_before,
    **DRAFT_LOOP_MUTATIONS,
}


@pytest.mark.parametrize("mutation", [None, *MUTATIONS])
def test_an_eagle_graph_that_skips_a_refresh_is_caught(llama_pair, mutation):
    """With graphs, the head's cache and every proposal equal the eager run's; a replay
    that keeps its hidden states, block table, slots or positions from an earlier step,
    or a first draft read from the wrong row, leaves other rows or drafts other tokens."""
    target_dir, head_dir = llama_pair
    _, _, eager_seen, eager = eagle_run(target_dir, head_dir, 1024, enforce_eager=True)
    prepare = None if mutation is None else MUTATIONS[mutation]
    _, _, seen, graphs = eagle_run(target_dir, head_dir, 1024, prepare=prepare)
    assert graphs.step_modes["graph"] > 0
    live = slice(0, -1)  # the spare last slot takes padded rows' writes
    difference = (graphs.caches[0][live] - eager.caches[0][live]).abs().max().item()
    if mutation is None:
        assert difference < 1e-4 and seen == eager_seen
    else:
        assert difference > 1e-3 or seen != eager_seen, f"{mutation} went unnoticed"


def test_a_mixed_batch_of_16_keeps_greedy_output_and_acceptance_with_graphs(pair):
    target_dir, head_dir = pair
    prompts = [list(range(10, 30)) + [i, i + 1] * (i % 3 + 1) for i in range(40, 56)]
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (20, 7, 13, 25) * 4
    ]
    args = dict(block_size=4, num_kv_blocks=512)
    plain = LLM(target_dir, **args).generate(prompts, params)
    metrics = {}
    for enforce_eager in (True, False):
        llm = LLM(
            target_dir,
            speculative_model=str(head_dir),
            speculative_method="eagle",
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


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def heldout_prompts() -> list[list[int]]:
    return code_prompts(Tokenizer.from_dir(DEMO_MODEL_DIR), 8)


def test_the_demo_head_keeps_greedy_output_at_batch_1_and_16(heldout_prompts):
    prompts = (heldout_prompts * 2)[:16]
    params = [greedy(n) for n in (40, 7, 23, 31) * 4]
    expected = [o.outputs[0].token_ids for o in LLM().generate(prompts, params)]
    for enforce_eager in (True, False):
        llm = LLM(speculative_method="eagle", enforce_eager=enforce_eager)
        for batch in (1, 16):
            got = llm.generate(prompts[:batch], params[:batch])
            assert [o.outputs[0].token_ids for o in got] == expected[:batch]
        assert llm.engine.stats().kv_blocks_used == 0


def accepted_length(heldout_prompts, **speculation) -> float:
    llm = LLM(num_speculative_tokens=3, **speculation)
    llm.generate(heldout_prompts, [greedy(64)] * len(heldout_prompts))
    return llm.engine.stats().speculative.mean_accepted_length


def test_the_demo_head_drafts_better_than_the_demo_draft_model(heldout_prompts):
    """On held-out code at k = 3 the trained head's mean accepted length (tokens per
    verify step) beats the demo draft model's, measured here on the same prompts: a head
    that drafts noise accepts about 1."""
    eagle = accepted_length(heldout_prompts, speculative_method="eagle")
    draft = accepted_length(heldout_prompts, speculative_model=str(DEMO_DRAFT_DIR))
    assert eagle > draft > 1.5, (eagle, draft)


def test_sampled_requests_with_eagle_finish_and_repeat_with_a_seed(heldout_prompts):
    params = [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24, seed=i) for i in range(4)]
    runs = []
    for _ in range(2):
        llm = LLM(speculative_method="eagle")
        runs.append([o.outputs[0].token_ids for o in llm.generate(heldout_prompts[:4], params)])
        assert sum(llm.engine.stats().speculative.accepted) > 0
        assert llm.engine.stats().kv_blocks_used == 0
    assert runs[0] == runs[1] and all(len(ids) == 24 for ids in runs[0])


def test_bad_heads_are_refused_by_name(tmp_path, tiny_llama, llama_pair):
    _, head_dir = llama_pair
    with pytest.raises(ValueError, match="needs speculative_model"):
        LLM(tiny_llama, speculative_method="eagle")
    with pytest.raises(ValueError, match="hidden_size"):
        LLM(DEMO_MODEL_DIR, speculative_method="eagle", speculative_model=str(head_dir))
    eagle3 = tmp_path / "eagle3"
    eagle3.mkdir()
    raw = json.loads((DEMO_EAGLE_DIR / "config.json").read_text())
    raw.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=1024)
    (eagle3 / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="EAGLE-3"):
        LLM(speculative_method="eagle", speculative_model=str(eagle3))
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        LLM(speculative_method="eagle", speculative_model=str(tmp_path))


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
def test_the_first_draft_costs_no_head_step_of_its_own(llama_pair, enforce_eager):
    """The mirror's output at each request's newest entry is what the first draft reads:
    a proposal of d drafts runs the mirror and d - 1 draft steps, no more (one by one, or
    inside the captured draft loop)."""
    target_dir, head_dir = llama_pair
    llm = LLM(
        target_dir,
        speculative_method="eagle",
        speculative_model=str(head_dir),
        num_speculative_tokens=3,
        block_size=4,
        num_kv_blocks=64,
        enforce_eager=enforce_eager,
    )
    proposer = llm.engine._proposer
    propose = proposer.propose
    calls = []

    def spy(inputs, output, drafting):
        before = proposer.step_modes.total()
        drafts = propose(inputs, output, drafting)
        depth = max((len(d.token_ids) for d in drafts.values()), default=0)
        calls.append((proposer.step_modes.total() - before, depth))
        return drafts

    proposer.propose = spy
    llm.generate([list(range(10, 30)), list(range(40, 47))], [greedy(12), greedy(9)])
    assert any(depth == 3 for _, depth in calls)
    for head_steps, depth in calls:
        assert head_steps == max(depth, 1), calls
