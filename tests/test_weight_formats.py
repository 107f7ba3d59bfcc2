"""Weights kept in the bytes they arrive in (bfloat16, float16) or quantized at load
(int8, int4 in groups): the kernels compute the product with the weights each format
stands for, the engine's logits equal a float32 engine's on those weights, and no
float32 copy of a linear weight is ever made."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.common import stored_in
from tests.helpers import greedy
from updraft import LLM
from updraft.demo import DEMO_EAGLE_DIR, DEMO_MODEL_DIR
from updraft.kernels import ops
from updraft.kernels.build import kernel_builds
from updraft.kernels.panels import Panels, pack, pack_stacked, quantize, unpack
from updraft.model_config import ModelConfig
from updraft.models.layers import ACTIVATIONS
from updraft.models.loader import load_model
from updraft.models.moe import PackedExperts
from updraft.models.packed_linear import PackedLinear
from updraft.weights import WeightFormat

from .checkpoints import build_checkpoint
from .probes import logits_of, probed, records

pytestmark = pytest.mark.skipif(
    not kernel_builds("linear"), reason="needs a C compiler to build the linear kernel"
)

FORMATS = {
    "float32": WeightFormat("float32"),
    "bfloat16": WeightFormat("bfloat16"),
    "float16": WeightFormat("float16"),
    "int8": WeightFormat("int8"),
    "int8-g32": WeightFormat("int8", 32),
    "int4-g32": WeightFormat("int4", 32),
    "int4-g128-zero": WeightFormat("int4", 128, zero_point=True),
    "int4-g48-zero": WeightFormat("int4", 48, zero_point=True),  # a short last group
}


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS.keys())
@pytest.mark.parametrize("shape", [(37, 128), (64, 100)])  # a partial panel; K not 2^n
@pytest.mark.usefixtures("all_cores")
def test_the_panel_kernel_computes_the_product_with_the_weights_the_format_stands_for(fmt, shape):
    torch.manual_seed(0)
    weight = torch.randn(*shape)
    panels = pack(weight, fmt)
    dequantized = unpack(panels)
    # 1-6 rows in registers (1 and 2 with two accumulator sets), 7 and 33 widened per panel
    for rows in (1, 2, 5, 6, 7, 33):
        x, bias = torch.randn(rows, shape[1]), torch.randn(shape[0])
        got = torch.ops.updraft.panel_linear(
            x, panels.codes, panels.scales, panels.zeros, bias, panels.code, panels.group, shape[0]
        )
        expected = F.linear(x.double(), dequantized.double(), bias.double()).float()
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)
    if not fmt.quantized:
        assert torch.equal(dequantized, weight.to(getattr(torch, fmt.name)).float())


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.mark.parametrize("march", ["haswell", "x86-64"])
def test_the_kernel_built_for_narrower_instructions_computes_the_same(march):
    """The AVX2 and plain-C paths of the kernel, which a machine with AVX-512 never runs
    in its -march=native build, built for those instructions and checked like it."""
    if march == "haswell" and not {"avx2", "fma", "f16c", "bmi2"} <= cpu_flags():
        pytest.skip("this CPU cannot run AVX2 code")
    torch.manual_seed(0)
    for fmt in FORMATS.values():
        weight = torch.randn(40, 96)
        panels = pack(weight, fmt)
        for rows in (1, 2, 5, 7):
            x, bias = torch.randn(rows, 96), torch.randn(40)
            args = (x, panels.codes, panels.scales, panels.zeros, bias, panels.code, panels.group)
            got = ops.panel_linear(*args, 40, march=march)
            native = ops.panel_linear(*args, 40)
            torch.testing.assert_close(got, native, atol=1e-5, rtol=1e-5)


# N of 3 and 4 panels, the last partial (the products take panels two at a time); K odd
# (a pair completed by a zero), 1031 over more than two blocks of 256 pairs.
BF16_SHAPES = [(37, 97), (53, 1031)]


def needs_bf16_products() -> int:
    """The row count from which the native build multiplies in bfloat16; skips where
    the CPU cannot."""
    if "avx512_bf16" not in cpu_flags():
        pytest.skip("this CPU has no avx512_bf16: no bfloat16 products to test")
    start = ops.bf16_product_rows()
    assert 1 < start <= 8  # built for them, and a batch-1 decode step stays exact
    return start


@pytest.mark.parametrize("shape", BF16_SHAPES)
@pytest.mark.usefixtures("all_cores")
def test_bfloat16_products_multiply_x_rounded_to_bfloat16_from_a_few_rows(shape):
    """Where the CPU has AVX512-BF16, bfloat16 panels in ``BF16_PRODUCTS`` take x
    rounded to bfloat16 at every row count (products from ``bf16_product_rows()``
    rows, the exact kernel on the rounded x below): float64's product with the rounded
    x, up to float32 sums, so a row's value does not depend on its step's size."""
    start = needs_bf16_products()
    torch.manual_seed(3)
    n, k = shape
    panels = pack(torch.randn(n, k), FORMATS["bfloat16"])
    weight = unpack(panels).double()
    for rows in sorted({1, 3, start - 1, start, 17, 64}):
        x, bias = torch.randn(rows, k), torch.randn(n)
        got = torch.ops.updraft.panel_linear(
            x, panels.codes, None, None, bias, ops.BF16_PRODUCTS, 0, n
        ).double()
        exact = F.linear(x.double(), weight, bias.double())
        rounded = F.linear(x.bfloat16().double(), weight, bias.double())
        # fewer rows than the products take run the exact kernel on x rounded alike
        torch.testing.assert_close(got, rounded, atol=5e-4, rtol=1e-5)
        assert (rounded - exact).abs().max() > 1e-2  # the rounding is what it checks


@pytest.mark.parametrize("march", ["haswell", "x86-64"])
def test_without_avx512_bf16_bfloat16_products_are_the_exact_product(march):
    """The AVX2 and plain-C builds have no bfloat16 products: ``BF16_PRODUCTS`` panels
    (in pairs along K) multiply float32 x exactly at every row count."""
    if march == "haswell" and not {"avx2", "fma", "f16c", "bmi2"} <= cpu_flags():
        pytest.skip("this CPU cannot run AVX2 code")
    assert ops.bf16_product_rows(march) == 0
    torch.manual_seed(4)
    for n, k in BF16_SHAPES:
        panels = pack(torch.randn(n, k), FORMATS["bfloat16"])
        for rows in (1, 3, 17, 64):
            x, bias = torch.randn(rows, k), torch.randn(n)
            got = ops.panel_linear(
                x, panels.codes, None, None, bias, ops.BF16_PRODUCTS, 0, n, march=march
            )
            expected = F.linear(x.double(), unpack(panels).double(), bias.double())
            torch.testing.assert_close(got.double(), expected, atol=2e-4, rtol=1e-5)


@pytest.mark.usefixtures("all_cores")
def test_grouped_experts_in_bfloat16_products_round_the_x_of_every_expert():
    """Each expert's gate_up and down products take their x rounded to bfloat16,
    whether the expert has ``bf16_product_rows()`` rows or more (products) or fewer."""
    start = needs_bf16_products()
    torch.manual_seed(5)
    experts, hidden, inter = 3, 97, 40
    gate_up = pack_stacked(torch.randn(experts, 2 * inter, hidden) * 0.1, FORMATS["bfloat16"])
    down = pack_stacked(torch.randn(experts, hidden, inter) * 0.1, FORMATS["bfloat16"])
    counts = torch.tensor([start - 1, 0, start + 5])
    x = torch.randn(int(counts.sum()), hidden)
    got = torch.ops.updraft.grouped_mlp(
        x, F.pad(counts.cumsum(0), (1, 0)), gate_up.codes, None, None, down.codes, None,
        None, ops.BF16_PRODUCTS, 0, 0, inter,
    )  # fmt: skip
    expected, first = [], 0
    for expert, count in enumerate(counts.tolist()):
        rounding = lambda t: t.bfloat16().double()  # noqa: E731
        rows = x[first : first + count].double()
        gate_up_out = F.linear(rounding(rows), one_expert(gate_up, expert)).float()
        gate, up = gate_up_out.chunk(2, dim=-1)
        expected.append(F.linear(rounding((F.silu(gate) * up).double()), one_expert(down, expert)))
        first += count
    torch.testing.assert_close(got, torch.cat(expected).float(), atol=2e-4, rtol=1e-5)


@pytest.mark.parametrize("fmt", [f for f in FORMATS.values() if f.quantized], ids=str)
def test_quantization_is_within_half_a_step_of_every_weight(fmt):
    torch.manual_seed(0)
    weight = torch.randn(40, 96) * torch.logspace(-3, 2, 40)[:, None]  # rows of any scale
    weight[3] = weight[3].abs()  # a row all of one sign
    codes, scales, zeros = quantize(weight, fmt)
    group = fmt.group_size or 96
    step = scales.repeat_interleave(group, dim=1)[:, :96]
    error = (unpack(pack(weight, fmt)) - weight).abs()
    assert (error <= step / 2 + 1e-6 * weight.abs()).all()
    top = {"int8": 127, "int4": 15}[fmt.name]
    assert codes.int().abs().max() <= top and (zeros is None) != fmt.zero_point


def one_expert(panels: Panels, expert: int) -> torch.Tensor:
    """The float64 weight of one expert of stacked panels."""
    parts = (None if t is None else t[expert] for t in (panels.codes, panels.scales, panels.zeros))
    one = Panels(*parts, panels.format, panels.group, panels.out_features, panels.in_features)
    return unpack(one).double()


@pytest.mark.parametrize(
    "fmt", [FORMATS[name] for name in ("bfloat16", "int8", "int4-g32", "int4-g48-zero")], ids=str
)
@pytest.mark.usefixtures("all_cores")
def test_grouped_experts_compute_each_rows_expert_in_every_format(fmt):
    torch.manual_seed(1)
    experts, hidden, inter = 4, 96, 40
    gate_up = torch.randn(experts, 2 * inter, hidden) * 0.1
    down = torch.randn(experts, hidden, inter) * 0.1
    gate_up_panels, down_panels = pack_stacked(gate_up, fmt), pack_stacked(down, fmt)
    counts = torch.tensor([3, 0, 1, 9])  # an idle expert, and one past six rows
    x = torch.randn(int(counts.sum()), hidden)
    got = torch.ops.updraft.grouped_mlp(
        x,
        F.pad(counts.cumsum(0), (1, 0)),
        gate_up_panels.codes,
        gate_up_panels.scales,
        gate_up_panels.zeros,
        down_panels.codes,
        down_panels.scales,
        down_panels.zeros,
        gate_up_panels.code,
        gate_up_panels.group,
        down_panels.group,
        inter,
    )
    expected, first = [], 0
    for expert, count in enumerate(counts.tolist()):
        rows = x[first : first + count].double()
        gate, up = F.linear(rows, one_expert(gate_up_panels, expert)).chunk(2, dim=-1)
        expected.append(F.linear(F.silu(gate) * up, one_expert(down_panels, expert)))
        first += count
    torch.testing.assert_close(got, torch.cat(expected).float(), atol=1e-4, rtol=1e-5)


# What is not a linear layer's or an expert's weight, kept as the checkpoint has it: the
# embedding, DeepSeek's absorbed kv_b_proj (read as a matrix inside attention), routers
# and the gate of a shared expert (Qwen2-MoE, Qwen3.5-MoE).
NOT_PACKED = ("embed_tokens", "kv_b_proj", "mlp.gate.weight", "shared_expert_gate")


def dequantized_checkpoint(source, directory, fmt: WeightFormat):
    """``source`` with every linear and expert weight replaced by the float32 weight its
    ``fmt`` packing stands for; the LM head untied, since it is packed and the embedding
    is not."""
    shutil.copytree(source, directory)
    tensors = load_file(directory / "model.safetensors")
    config = json.loads((directory / "config.json").read_text())
    if config.get("tie_word_embeddings"):
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
        config["tie_word_embeddings"] = False
    config["torch_dtype"] = config["dtype"] = "float32"
    (directory / "config.json").write_text(json.dumps(config))
    for name, tensor in tensors.items():
        tensors[name] = tensor.float()
        if tensor.dim() == 2 and not any(part in name for part in NOT_PACKED):
            tensors[name] = unpack(pack(tensor, fmt)).contiguous()
    save_file(tensors, directory / "model.safetensors")
    return directory


PROMPTS = [[1, 2, 3, 4, 5], list(range(40, 80)), [7] * 19]


def tokens_and_logits(llm: LLM, steps: int = 24):
    outputs = llm.generate(PROMPTS, greedy(steps))
    seen = records(llm)
    return (
        [output.outputs[0].token_ids for output in outputs],
        [logits_of(seen, output) for output in outputs],
    )


@pytest.mark.parametrize(
    "kind, fmt",
    [
        ("llama", "bfloat16"),
        ("qwen2", "float16"),
        ("deepseek-v3", "bfloat16"),
        ("llama", "int8"),
        ("deepseek-v3.2", "int8"),
        ("llama", "int4"),
        ("deepseek-v3", "int4"),
        ("qwen3.5", "bfloat16"),
        ("qwen3.5", "int8"),
        ("qwen3.5", "int4"),
        ("qwen3.5-moe", "int4"),
    ],
)
def test_the_engine_equals_float32_on_the_weights_each_format_stands_for(kind, fmt, tmp_path):
    """Over a prefill and 24 decode steps, with graphs: half-precision weights kept in 2
    bytes against the same checkpoint widened to float32 at load (bfloat16's batches
    exact, not in bfloat16 products); quantized weights against a float32 checkpoint of
    their dequantized values."""
    source = build_checkpoint(kind, tmp_path / "source")
    if fmt in ("bfloat16", "float16"):
        checkpoint = stored_in(source, getattr(torch, fmt), tmp_path)
        reference = probed(checkpoint, num_kv_blocks=32, dtype="float32", compile_graphs=False)
        # the exact path: bfloat16's batches not in bfloat16 products
        ours = probed(checkpoint, num_kv_blocks=32, compile_graphs=False, activations="float32")
    else:
        quantization = {"int8": {}, "int4": {"quantization_group_size": 32}}[fmt]
        stands_for = WeightFormat(fmt, quantization and 32, zero_point=fmt == "int4")
        checkpoint = dequantized_checkpoint(source, tmp_path / fmt, stands_for)
        reference = probed(checkpoint, num_kv_blocks=32, compile_graphs=False)
        ours = probed(
            source,
            num_kv_blocks=32,
            quantization=fmt,
            compile_graphs=False,
            activations="float32",  # the exact path: x is not rounded
            **quantization,
        )
    assert str(ours.engine.config.weight_format(ours.engine.model_config)).startswith(fmt)
    want_tokens, want_logits = tokens_and_logits(reference)
    got_tokens, got_logits = tokens_and_logits(ours)
    assert got_tokens == want_tokens
    for got, want in zip(got_logits, want_logits, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


class CreatedTensors(TorchDispatchMode):
    """Every tensor any op returns: (dtype, shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.created: set[tuple[torch.dtype, tuple[int, ...]]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor):
                self.created.add((tensor.dtype, tuple(tensor.shape)))
        return out


@pytest.mark.parametrize("quantization", [None, "int4"])
def test_no_float32_copy_of_a_linear_weight_is_made_in_a_step(quantization, tmp_path):
    """Prefill and decode steps (eager and graphs, a dense and an expert model) create no
    float32 tensor shaped like a linear or expert weight (or its transpose)."""
    for kind in ("llama", "deepseek-v3"):
        checkpoint = stored_in(build_checkpoint(kind, tmp_path / kind), torch.bfloat16, tmp_path)
        config = ModelConfig.from_dir(checkpoint)
        # Shapes of every packed weight: [N, K] of each linear, [E, N, K] of the experts.
        model = load_model(config, checkpoint, torch.float32, weights=WeightFormat("bfloat16"))
        shapes = set()
        for module in model.modules():
            if isinstance(module, PackedLinear):
                shapes |= {(module.out_features, module.in_features)}
            elif isinstance(module, PackedExperts):
                experts, inter = module.num_experts, module.inter
                shapes |= {(2 * inter, config.hidden_size), (config.hidden_size, inter)}
                shapes |= {(experts, *shape) for shape in set(shapes)}
        shapes |= {shape[::-1] for shape in shapes}
        assert (256, 64) in shapes  # the LM head, at least
        for eager in (True, False):
            llm = LLM(
                checkpoint,
                num_kv_blocks=32,
                quantization=quantization,
                quantization_group_size=32,
                enforce_eager=eager,
                compile_graphs=False,
                capture_tokens=(36,),  # the prefill's 17 tokens pad to 36, no weight's size
            )
            spy = CreatedTensors()
            with spy:
                # 7 and 3 prompt tokens, 3 requests: no weight dimension is any of them
                llm.generate([[1] * 7, [2] * 3, [3] * 7], greedy(4))
            widened = {s for dtype, s in spy.created if dtype == torch.float32} & shapes
            assert not widened, (kind, eager, widened)
            assert any(dtype == torch.float32 for dtype, _ in spy.created)  # the spy saw steps


def test_every_linear_and_expert_is_packed_and_the_embedding_stays_as_loaded(tmp_path):
    checkpoint = stored_in(
        build_checkpoint("deepseek-v3", tmp_path / "v3"), torch.bfloat16, tmp_path
    )
    config = ModelConfig.from_dir(checkpoint)
    model = load_model(config, checkpoint, torch.float32, weights=WeightFormat("bfloat16"))
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert sum(isinstance(m, PackedExperts) for m in model.modules()) == 2
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    packed = {b.dtype for m in model.modules() if isinstance(m, PackedLinear) for b in [m.codes]}
    assert packed == {torch.bfloat16}
    others = {p.dtype for name, p in model.named_parameters() if "embed_tokens" not in name}
    assert others == {torch.float32}  # norms, biases, the router, kv_b_proj


def test_auto_keeps_a_half_precision_checkpoints_dtype_on_the_cpu(tmp_path):
    checkpoint = stored_in(build_checkpoint("llama", tmp_path / "llama"), torch.bfloat16, tmp_path)
    config = ModelConfig.from_dir(checkpoint)
    for engine, expected in [
        ({}, "bfloat16"),
        ({"dtype": "float32"}, "float32"),
        ({"quantization": "int8"}, "int8"),
        ({"quantization": "int4"}, "int4, groups of 128, zero points"),
        (
            {"quantization": "int4", "quantization_group_size": 32},
            "int4, groups of 32, zero points",
        ),
    ]:
        llm = LLM(checkpoint, num_kv_blocks=16, **engine)
        assert str(llm.engine.config.weight_format(config)) == expected
        llm.engine.close()


def test_bad_quantization_settings_are_named(tiny_llama):
    with pytest.raises(ValueError, match="quantization must be one of int8, int4, got 'int3'"):
        LLM(tiny_llama, num_kv_blocks=16, quantization="int3")
    with pytest.raises(
        ValueError, match="'int8' runs on the CPU in float32, not on cpu in bfloat16"
    ):
        LLM(tiny_llama, num_kv_blocks=16, quantization="int8", dtype="bfloat16")
    with pytest.raises(ValueError, match="quantization_group_size must be one of 32, 128, got 64"):
        LLM(tiny_llama, num_kv_blocks=16, quantization="int4", quantization_group_size=64)


def test_eagle_graphs_on_a_bfloat16_target_equal_eager(tmp_path):
    """The demo target stored in bfloat16, its float16 EAGLE head kept in the target's
    format: captured target, head and draft-loop steps give eager's tokens and logits."""
    target = stored_in(DEMO_MODEL_DIR, torch.bfloat16, tmp_path)
    runs = {}
    for eager in (True, False):
        llm = probed(
            target,
            speculative_method="eagle",
            speculative_model=str(DEMO_EAGLE_DIR),
            num_speculative_tokens=3,
            enforce_eager=eager,
            compile_graphs=False,
            num_kv_blocks=64,
        )
        runs[eager] = tokens_and_logits(llm)
    assert runs[False][0] == runs[True][0]
    for got, want in zip(runs[False][1], runs[True][1], strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("quantization", [None, "int4"], ids=["bfloat16", "int4"])
def test_two_ranks_keep_the_format_and_compute_what_one_process_computes(
    quantization, tmp_path, pool
):
    checkpoint = stored_in(build_checkpoint("llama", tmp_path / "llama"), torch.bfloat16, tmp_path)
    args = dict(
        num_kv_blocks=64,
        compile_graphs=False,
        quantization=quantization,
        quantization_group_size=32,
        activations="float32",  # rounding x, a rank's partial sums could flip a code
    )
    want_tokens, want_logits = tokens_and_logits(probed(checkpoint, **args))
    got_tokens, got_logits = tokens_and_logits(
        probed(checkpoint, worker_pool=pool, tensor_parallel_size=2, **args)
    )
    assert got_tokens == want_tokens
    for got, want in zip(got_logits, want_logits, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_quantization_groups_a_tensor_parallel_split_would_cut_are_refused(tmp_path):
    checkpoint = build_checkpoint("llama", tmp_path / "llama")  # o_proj: 64 columns
    with pytest.raises(ValueError, match=r"groups of 128 columns would straddle .* o_proj \(32"):
        LLM(checkpoint, quantization="int4", tensor_parallel_size=2, num_kv_blocks=16)


@pytest.mark.parametrize("march", ["native", "haswell", "x86-64"])
def test_grouped_experts_take_the_gates_activation_in_every_build(march):
    """GELU-tanh gates (Gemma 4's experts) as torch computes them, in the native, AVX2
    and plain-C builds; SiLU stays the default."""
    if march == "haswell" and not {"avx2", "fma", "f16c", "bmi2"} <= cpu_flags():
        pytest.skip("this CPU cannot run AVX2 code")
    torch.manual_seed(2)
    experts, hidden, inter = 3, 32, 24
    fmt = FORMATS["float32"]
    gate_up_panels = pack_stacked(torch.randn(experts, 2 * inter, hidden) * 0.3, fmt)
    down_panels = pack_stacked(torch.randn(experts, hidden, inter) * 0.3, fmt)
    counts = torch.tensor([2, 0, 5])
    x = torch.randn(int(counts.sum()), hidden)
    weights = [
        getattr(panels, name)
        for panels in (gate_up_panels, down_panels)
        for name in ("codes", "scales", "zeros")
    ]
    groups = (gate_up_panels.code, gate_up_panels.group, down_panels.group, inter)
    offsets = F.pad(counts.cumsum(0), (1, 0))
    for name in ("silu", "gelu_pytorch_tanh"):  # gpt-oss's clamped SwiGLU: test_gpt_oss
        index = ops.EXPERT_ACTIVATIONS.index(name)
        got = ops.grouped_mlp(x, offsets, *weights, *groups, index, march=march)
        expected, first = [], 0
        for expert, count in enumerate(counts.tolist()):
            rows = x[first : first + count].double()
            gate, up = F.linear(rows, one_expert(gate_up_panels, expert)).chunk(2, dim=-1)
            gated = ACTIVATIONS[name](gate) * up
            expected.append(F.linear(gated, one_expert(down_panels, expert)))
            first += count
        torch.testing.assert_close(got, torch.cat(expected).float(), atol=1e-5, rtol=1e-5)
