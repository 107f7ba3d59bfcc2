"""Sliding-window attention against transformers, in every path that reads the cache.

Tiny random Mistral (every layer windowed), Qwen2 (windows from max_window_layers on),
Phi-3 (every layer) and Gemma 3 (sliding and full layers mixed, each kind with its own
RoPE base; also loaded as the text tower of Gemma3ForConditionalGeneration), each with
a window shorter than the prompts: logits within 1e-4 of transformers' forward over
prefill and 24 decode steps, whole and chunked; greedy output equal to ``generate``
eager and with FULL and PIECEWISE graphs; the same tokens and logits split over ranks
(TP=2, and DCP=2); speculation that changes no token; and blocks no window reaches any
more given back while a request runs.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from tests.checkpoints import WINDOW, build_checkpoint, eagle_head_checkpoint, tiny_config
from tests.helpers import greedy, token_ids
from tests.probes import assert_idle, count_prefix_hits, logits_of, probed, records
from tests.test_reference_models import PROMPTS, assert_logits_match
from tests.window_checks import budget_gib, run_checked
from updraft import LLM
from updraft.attention.metadata import AttentionGroup, AttentionMetadata
from updraft.engine.kv_blocks import KVCacheManager
from updraft.model_config import ModelConfig

# The families' names of each kind in tests/checkpoints.py.
WINDOWED = {
    "gemma3": "gemma3",
    "mistral": "mistral-window",
    "phi3": "phi3-window",
    "qwen2": "qwen2-window",
}
KINDS = sorted(WINDOWED)


@pytest.fixture(scope="module", params=KINDS)
def windowed(request, tmp_path_factory):
    kind = request.param
    return kind, build_checkpoint(WINDOWED[kind], tmp_path_factory.mktemp(f"window-{kind}"))


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    return build_checkpoint("mistral-window", tmp_path_factory.mktemp("window-mistral"))


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return build_checkpoint("gemma3", tmp_path_factory.mktemp("window-gemma3"))


def test_configs_give_each_layer_its_window(windowed):
    kind, directory = windowed
    expected = {
        "mistral": (WINDOW, WINDOW),
        "phi3": (WINDOW, WINDOW),
        "qwen2": (None, WINDOW - 2, WINDOW - 2),
        "gemma3": (WINDOW, None, WINDOW, None),
    }[kind]
    assert ModelConfig.from_dir(directory).layer_windows == expected


def test_a_published_gemma3_config_is_read_as_transformers_reads_it():
    """Gemma 3 4B's config as published: a sparse text_config (the rest transformers'
    defaults), the global RoPE scaled linearly, the local base and the layer pattern
    implied."""
    raw = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": {
            "hidden_size": 2560,
            "intermediate_size": 10240,
            "model_type": "gemma3_text",
            "num_hidden_layers": 34,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024,
        },
        "vision_config": {"model_type": "siglip_vision_model"},
        "torch_dtype": "bfloat16",
    }
    ours = ModelConfig.from_dict(raw)
    theirs = transformers.Gemma3Config(**raw).text_config
    expected = tuple(
        theirs.sliding_window if kind == "sliding_attention" else None
        for kind in theirs.layer_types
    )
    assert ours.layer_windows == expected and expected.count(None) == 5
    full, local = (theirs.rope_parameters[k] for k in ("full_attention", "sliding_attention"))
    assert (ours.rope.theta, ours.rope.kind, ours.rope.factor) == (
        full["rope_theta"],
        full["rope_type"],
        full["factor"],
    )
    assert (ours.local_rope.theta, ours.local_rope.kind) == (local["rope_theta"], "default")
    assert ours.attention_scale == theirs.query_pre_attn_scalar**-0.5
    assert (ours.num_heads, ours.num_kv_heads, ours.head_dim) == (
        theirs.num_attention_heads,
        theirs.num_key_value_heads,
        theirs.head_dim,
    )
    assert (ours.vocab_size, ours.checkpoint_dtype) == (theirs.vocab_size, "bfloat16")


@pytest.mark.parametrize(
    "change, named",
    [
        ({"layer_types": ["sliding_attention"]}, "layer_types"),
        ({"sliding_window": 0}, "sliding_window"),
        ({"hidden_activation": "relu"}, "hidden_activation"),
        ({"attn_logit_softcapping": 50.0}, "soft-capping"),
        ({"sliding_window": None}, "sliding_window"),
    ],
)
def test_a_gemma3_config_it_cannot_serve_is_refused_by_name(change, named):
    raw = {**tiny_config("gemma3").to_dict(), "architectures": ["Gemma3ForCausalLM"], **change}
    with pytest.raises(ValueError, match=named):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize("token_budget", [1024, 10], ids=["whole-prefill", "chunked-prefill"])
def test_logits_match_transformers(windowed, token_budget):
    assert_logits_match(windowed[1], token_budget)


def test_the_text_tower_of_gemma3_for_conditional_generation_loads_by_name(tmp_path):
    assert_logits_match(build_checkpoint("gemma3-multimodal", tmp_path))


def assert_greedy_equals_generate(directory, modes) -> None:
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    expected = []
    for prompt in PROMPTS:
        out = reference.generate(
            torch.tensor([prompt]), max_new_tokens=30, do_sample=False, pad_token_id=0
        )
        expected.append(out[0, len(prompt) :].tolist())
    for mode in modes:
        llm = LLM(directory, block_size=4, num_kv_blocks=96, **mode)
        assert token_ids(llm.generate(PROMPTS, greedy(30))) == expected, mode
        steps = llm.engine.stats().steps
        replayed = any(step.startswith("graph") for step in steps)
        assert replayed != bool(mode.get("enforce_eager")), steps


GRAPH_MODES = [{"graph_mode": "full"}, {"graph_mode": "piecewise"}]


@pytest.mark.parametrize("kind", ["mistral", "gemma3"])
def test_greedy_equals_generate_eager_and_with_full_and_piecewise_graphs(kind, request):
    directory = request.getfixturevalue(kind)
    assert_greedy_equals_generate(directory, [{"enforce_eager": True}, *GRAPH_MODES])


# -- split over ranks ----------------------------------------------------------------------

ARGS = dict(block_size=4, num_kv_blocks=128, max_num_batched_tokens=32)
PARAMS = [greedy(n) for n in (14, 9, 20, 6)]


def _run(checkpoint, **args):
    llm = probed(str(checkpoint), **{**ARGS, **args})
    outputs = llm.generate(PROMPTS, PARAMS)
    assert_idle(llm)
    steps = llm.engine.stats().steps
    seen = records(llm)
    return token_ids(outputs), [logits_of(seen, output) for output in outputs], steps


def _gemma3_pools(gemma3) -> dict:
    """Two running requests and a budget whose windowed pool (what they can hold at
    most) goes round while the full pool is roomy: the kinds' block ids part, so a rank
    that wrote or read a windowed layer through the full table would show."""
    return dict(max_num_seqs=2, num_kv_blocks=None, kv_cache_memory_gib=budget_gib(gemma3, 100, 24))


@pytest.fixture(scope="module")
def gemma3_in_one_process(gemma3):
    """(tokens, logits) one process computes on Gemma 3, for every layout's test: values
    only, from an engine no test sees, so the layouts cannot disturb each other."""
    tokens, logits, _ = _run(gemma3, **_gemma3_pools(gemma3))
    return tokens, logits


@pytest.mark.parametrize(
    "layout",
    [
        dict(tensor_parallel_size=2),
        dict(tensor_parallel_size=2, decode_context_parallel_size=2),
        dict(prefill_context_parallel_size=2),
    ],
    ids=["tp2", "tp2-dcp2", "pcp2"],
)
def test_ranks_compute_what_one_process_computes(gemma3, gemma3_in_one_process, layout, pool):
    """Gemma 3's mix of sliding and full layers: under DCP each rank keeps every other
    position, and a window starts at a rank's own first position inside it; under PCP
    each rank's prefill chunks attend as continuations, narrowed by the window."""
    tokens, logits = gemma3_in_one_process
    split_tokens, split_logits, steps = _run(
        gemma3, worker_pool=pool, **_gemma3_pools(gemma3), **layout
    )
    split = any("split over 2 ranks" in mode for mode in steps)
    assert split == ("prefill_context_parallel_size" in layout), steps
    assert split_tokens == tokens
    for mine, theirs in zip(split_logits, logits, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=0)


# -- speculation ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["mistral", "gemma3"])
def test_speculation_with_a_window_shorter_than_the_prompt_changes_no_token(
    kind, request, tmp_path
):
    """Every layer windowed (blocks given back, the draft model's too) and Gemma 3's
    mix (an EAGLE head over its scaled embeddings and capped logits)."""
    target = request.getfixturevalue(kind)
    prompts = [list(range(3, 40)), [7, 8, 9] * 10, list(range(100, 125))]
    params = [greedy(40) for _ in prompts]
    args = dict(block_size=4, num_kv_blocks=128)
    plain = token_ids(LLM(target, **args).generate(prompts, params))
    head = eagle_head_checkpoint(tmp_path / "head", target)
    proposers = {
        "ngram": dict(speculative_method="ngram"),
        "draft": dict(speculative_model=str(target)),
        "eagle": dict(speculative_method="eagle", speculative_model=str(head)),
    }
    for name, proposer in proposers.items():
        llm = LLM(target, num_speculative_tokens=3, **args, **proposer)
        assert token_ids(llm.generate(prompts, params)) == plain, name
        metrics = llm.engine.stats().speculative
        assert metrics.num_draft_tokens > 0, name
        if name == "draft":  # the model drafting for itself: every draft is accepted
            assert metrics.acceptance_rate == 1.0, metrics.summary()


# -- blocks given back ---------------------------------------------------------------------


def _held_blocks_over_a_run(llm: LLM, prompt: list[int], max_tokens: int) -> list[int]:
    """The blocks the pool has in use after each step of one request."""
    engine = llm.engine
    engine.add_request(prompt, greedy(max_tokens))
    pool = engine._scheduler.kv.pool  # noqa: SLF001 (the pool is what is asserted)
    held = []
    while engine.has_unfinished:
        engine.step()
        held.append(pool.num_used)
    return held


def test_a_long_output_holds_only_the_blocks_its_window_reaches(tmp_path):
    """Mistral-style, every layer's window 64: a 1,000-token output holds at most
    window / block_size + 2 blocks, and gets the logits of a run that gives none back."""
    window, block_size = 64, 16
    directory = build_checkpoint(
        "mistral-window", tmp_path, sliding_window=window, max_position_embeddings=2048
    )
    prompt = list(range(1, 100))
    llm = LLM(directory, block_size=block_size, num_kv_blocks=200, enable_prefix_caching=False)
    held = _held_blocks_over_a_run(llm, prompt, 1000)
    assert len(held) >= 1000
    assert max(held) <= window // block_size + 2, max(held)
    assert llm.engine._scheduler.kv.pool.num_used == 0  # noqa: SLF001


def test_a_proposer_without_a_window_keeps_every_block(mistral, tmp_path):
    head = eagle_head_checkpoint(tmp_path / "head", mistral)
    kept = LLM(mistral, speculative_method="eagle", speculative_model=str(head), block_size=4)
    assert kept.engine._scheduler.kv.window is None  # noqa: SLF001
    released = LLM(mistral, speculative_model=str(mistral), block_size=4)
    assert released.engine._scheduler.kv.window == WINDOW  # noqa: SLF001


def test_blocks_given_back_are_reused_by_other_requests_without_a_token_changing(mistral):
    """A pool so small that the blocks one request gives back are soon another's: a
    block given back while a window still reads it would change tokens. After every
    step, every block a window still reads is held (``tests/window_checks.py``)."""
    prompts = [list(range(3 + i, 30 + i)) for i in range(6)]
    params = [greedy(60) for _ in prompts]
    roomy = token_ids(LLM(mistral, block_size=4, num_kv_blocks=512).generate(prompts, params))
    tight = LLM(mistral, block_size=4, num_kv_blocks=24, enable_prefix_caching=False)
    outputs = run_checked(tight, prompts, params)
    assert token_ids(outputs) == roomy
    # 6 requests of 87 tokens would need 132 blocks: the room came from the windows.
    assert sum(output.metrics.num_preemptions for output in outputs) == 0


def test_prefix_caching_stays_correct_with_windows(mistral, monkeypatch):
    shared = list(range(3, 40))
    prompts = [[*shared, 50 + i] for i in range(3)]
    params = greedy(30)
    fresh = [token_ids(LLM(mistral, block_size=4).generate([p], params))[0] for p in prompts]
    hits = count_prefix_hits(monkeypatch)
    llm = LLM(mistral, block_size=4, num_kv_blocks=64)
    served = [token_ids(llm.generate([p], params))[0] for p in prompts]
    assert served == fresh
    assert hits[0] == 0 and min(hits[1:]) == len(shared) // 4, hits


# -- mutations: each way of getting the window wrong fails a test --------------------------


def test_a_window_off_by_one_fails_the_parity_test(mistral, monkeypatch):
    window_mask = AttentionGroup.window_mask
    monkeypatch.setattr(AttentionGroup, "window_mask", lambda self, w: window_mask(self, w + 1))
    in_place_rows = AttentionMetadata.in_place_rows

    def one_more(self, index, window=None):
        return in_place_rows(self, index, None if window is None else window + 1)

    monkeypatch.setattr(AttentionMetadata, "in_place_rows", one_more)
    with pytest.raises(AssertionError):
        assert_logits_match(mistral)


def test_a_sliding_layer_with_the_global_rope_base_fails_the_parity_test(gemma3, monkeypatch):
    import updraft.models.gemma as gemma

    original = gemma.Gemma3ForCausalLM.__init__

    def global_rope(self, config, max_positions=None):
        original(self, config, max_positions)
        self.local_rotary = self.rotary  # the sliding layers' table is the global one

    monkeypatch.setattr(gemma.Gemma3ForCausalLM, "__init__", global_rope)
    with pytest.raises(AssertionError):
        assert_logits_match(gemma3)


@pytest.mark.parametrize("num_kv_blocks", [24, 512])
def test_a_block_given_back_while_its_window_reads_it_fails_for_any_pool_size(
    mistral, monkeypatch, num_kv_blocks
):
    """Given back one block early: in a pool of 512 blocks none is handed out again
    while the request runs, so its tokens stay right; the check of held blocks after
    each step fails anyway."""
    release = KVCacheManager.release_outside_window

    def one_block_early(self, request):
        self.window -= self.block_size
        try:
            release(self, request)
        finally:
            self.window += self.block_size

    monkeypatch.setattr(KVCacheManager, "release_outside_window", one_block_early)
    llm = LLM(mistral, block_size=4, num_kv_blocks=num_kv_blocks, enforce_eager=True)
    with pytest.raises(AssertionError, match="a window still reads"):
        run_checked(llm, [list(range(3, 30))], [greedy(30)])


def test_window_starts_not_derived_from_the_refreshed_lengths_are_refused_at_capture(
    mistral, monkeypatch
):
    """A captured decode whose window starts were computed once, host-side at capture,
    rather than from each replay's refreshed lengths, as a graph that left the window
    out of its refreshed state would replay them: the capture refuses to hold a tensor
    it neither produced nor declared. Eager steps, which build theirs each step, are
    unaffected."""
    from torch.utils._python_dispatch import _disable_current_modes

    from updraft.graph.recorded import CaptureError

    in_place_rows = AttentionMetadata.in_place_rows

    def taken_once(self, index, window=None):
        table, lens, starts = in_place_rows(self, index, window)
        if starts is not None and self.uniform:  # a FULL graph's bucket
            with _disable_current_modes():  # outside what the graph replays
                starts = starts.clone()
        return table, lens, starts

    monkeypatch.setattr(AttentionMetadata, "in_place_rows", taken_once)
    assert_greedy_equals_generate(mistral, [{"enforce_eager": True}])
    with pytest.raises(CaptureError, match=r"stale|declared"):
        LLM(mistral, block_size=4, num_kv_blocks=96, graph_mode="full")
