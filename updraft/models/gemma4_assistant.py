"""Gemma 4's assistant drafter, as transformers defines it (``Gemma4AssistantForCausalLM``).

Every draft step of a request is at one position, the position p of its newest token:

    x = pre_projection([target embedding of the step's token ; state])
    Gemma 4 decoder layers whose queries attend over the TARGET's K/V of positions
        0..p-1 (its last writing sliding and full layers': ``kv_store_layers``), a
        sliding layer over its last ``sliding_window + 1`` of them (transformers'
        bidirectional window, |q - kv| <= window, flipped onto the past)
    h = norm(x)
    logits = LM head(h) (or the centroid-masked head), uncapped
    next state = post_projection(h), at the target's width

The first step's state is the target's final hidden state at p - 1 and its token the
one at p; each later step's are the step before's projected state and its draft. The
drafter has no K/V of its own: it reads the target's paged cache through the step's
block table and writes nothing (its steps' slot mapping is -1 throughout).

``forward`` returns [h ; next state] per token: the runner reads logits from it with
``compute_logits`` and the proposer chains the state.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from updraft.attention.metadata import AttentionMetadata
from updraft.model_config.gemma4_assistant import AssistantConfig, assistant_config
from updraft.models.gemma4 import queries_over_cache
from updraft.models.layers import MLP, Matrix, RMSNorm
from updraft.models.loader import building, checkpoint_names, fill, weight_files
from updraft.models.rope import RotaryEmbedding
from updraft.weights import WeightFormat, torch_dtype

# The checkpoint's tensors that are no parameter: read on their own, and checked.
BUFFERS = ("masked_embedding.token_ordering",)


class AssistantAttention(nn.Module):
    """Queries only: keys and values are the target's, read from its cache."""

    def __init__(self, config: AssistantConfig, layer: int) -> None:
        super().__init__()
        self.layer = f"assistant.layers.{layer}.self_attn"  # its key as a captured task
        self.head_dim = config.head_dims[layer]
        self.num_heads = config.num_heads
        sliding = config.layer_types[layer] == "sliding_attention"
        # transformers' mask keeps |q - kv| <= window of the context's last entries: the
        # context's last window + 1 positions, the loop's window of a query one on.
        self.window = config.sliding_window + 1 if sliding else None
        self.q_proj = nn.Linear(config.hidden_size, config.num_heads * self.head_dim, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.o_proj = nn.Linear(config.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        return queries_over_cache(self, hidden, rotary, kv_cache, metadata)


class AssistantLayer(nn.Module):
    def __init__(self, config: AssistantConfig, layer: int) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.kind = config.layer_types[layer]
        self.self_attn = AssistantAttention(config, layer)
        self.mlp = MLP(size, config.intermediate_size, activation="gelu_pytorch_tanh")
        self.input_layernorm = RMSNorm(size, eps)
        self.post_attention_layernorm = RMSNorm(size, eps)
        self.pre_feedforward_layernorm = RMSNorm(size, eps)
        self.post_feedforward_layernorm = RMSNorm(size, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1))

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(hidden), rotary, kv_cache, metadata)
        hidden = hidden + self.post_attention_layernorm(attended)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        hidden = hidden + self.post_feedforward_layernorm(mlp)
        return hidden * self.layer_scalar


class MaskedEmbedder(nn.Module):
    """transformers' ``Gemma4AssistantMaskedEmbedder``: the vocabulary is in
    ``num_centroids`` clusters of equal size (``token_ordering`` lists each cluster's
    tokens); a row scores its ``centroid_intermediate_top_k`` best clusters' tokens
    with the LM head and gives every other token one logit below the least of those.
    transformers takes that least over the whole batch; here it is each row's, so a
    row's logits do not depend on the rows beside it (the same for one row)."""

    def __init__(self, config: AssistantConfig) -> None:
        super().__init__()
        self.top_k = config.centroid_intermediate_top_k
        self.centroids = nn.Linear(config.hidden_size, config.num_centroids, bias=False)
        self.token_ordering: torch.Tensor  # [vocab], registered by AssistantWeights
        self.clusters = (config.num_centroids, config.tokens_per_centroid)

    def forward(self, hidden: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
        """hidden [T, H], lm_head [vocab, H] -> logits [T, vocab]."""
        chosen = self.centroids(hidden).topk(self.top_k, dim=-1).indices  # [T, k]
        tokens = self.token_ordering.view(self.clusters).index_select(0, chosen.flatten())
        tokens = tokens.view(hidden.shape[0], -1)  # [T, k * tokens per cluster]
        rows = lm_head.index_select(0, tokens.flatten()).view(*tokens.shape, -1)
        scores = torch.einsum("th,tvh->tv", hidden, rows)
        floor = scores.amin(dim=-1, keepdim=True) - 1.0
        logits = floor.expand(-1, lm_head.shape[0]).contiguous()
        return logits.scatter_(-1, tokens, scores)


class AssistantWeights(nn.Module):
    """The drafter's own tensors, under the checkpoint's names."""

    def __init__(self, config: AssistantConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        backbone, size = config.backbone_hidden_size, config.hidden_size
        self.pre_projection = nn.Linear(2 * backbone, size, bias=False)
        self.post_projection = nn.Linear(size, backbone, bias=False)
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(
            AssistantLayer(config, i) for i in range(config.num_layers)
        )
        self.model.norm = RMSNorm(size, config.rms_norm_eps)
        # LM head rows read whole or row by row (the masked head), never packed
        self.model.embed_tokens = Matrix(config.vocab_size, size)  # the tied LM head
        self.lm_head = None if config.tie_word_embeddings else Matrix(config.vocab_size, size)
        self.masked_embedding = MaskedEmbedder(config) if config.use_ordered_embeddings else None
        if self.masked_embedding is not None:  # on the CPU, when built on the meta device
            device = torch.get_default_device()
            with torch.device("cpu" if device.type == "meta" else device):
                self.masked_embedding.register_buffer(
                    "token_ordering", torch.arange(config.vocab_size), persistent=False
                )
        # Each layer kind's queries turn as the target turned its keys.
        self.rotary = nn.ModuleDict()
        for kind, rope in config.rope.items():
            dims = {
                d for d, k in zip(config.head_dims, config.layer_types, strict=True) if k == kind
            }
            if len(dims) != 1:
                raise ValueError(f"the assistant's {kind} layers differ in head size: {dims}")
            self.rotary[kind] = RotaryEmbedding(rope, dims.pop(), max_positions)

    def head(self) -> torch.Tensor:
        return (self.model.embed_tokens if self.lm_head is None else self.lm_head).weight


class Gemma4Assistant(nn.Module):
    """The drafter (``weights``) over ``target``, whose embedding it reads, attending over
    the target's caches of layers ``store_layers`` (by layer kind)."""

    def __init__(
        self, weights: AssistantWeights, target: nn.Module, store_layers: dict[str, int]
    ) -> None:
        super().__init__()
        self.hidden_size = weights.post_projection.in_features
        self.store_layers = dict(store_layers)
        # Registered here, so a capture of the drafter sees them as weights; run through
        # the target's own embed (Gemma scales it).
        self.target_embed_tokens = target.model.embed_tokens
        self.target_embed = target.embed
        self.weights = weights

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
        hidden_states: torch.Tensor,
    ) -> torch.Tensor:
        """Tokens ``input_ids`` at ``positions`` beside the states ``hidden_states``
        [T, backbone] -> [T, hidden + backbone]: the normed output, then the next state.
        ``kv_caches``: the target's, one per target layer."""
        weights = self.weights
        embeds = self.target_embed(input_ids)
        hidden = weights.pre_projection(torch.cat([embeds, hidden_states.to(embeds.dtype)], dim=-1))
        rotary = {
            kind: table.lookup(positions, hidden.dtype) for kind, table in weights.rotary.items()
        }
        for layer in weights.model.layers:
            cache = kv_caches[self.store_layers[layer.kind]]
            hidden = layer(hidden, rotary[layer.kind], cache, metadata)
        hidden = weights.model.norm(hidden)
        return torch.cat([hidden, weights.post_projection(hidden)], dim=-1)

    def next_states(self, output: torch.Tensor) -> torch.Tensor:
        """The state the next draft step reads, of ``forward``'s output rows."""
        return output[:, self.hidden_size :]

    def compute_logits(self, output: torch.Tensor) -> torch.Tensor:
        hidden, head = output[:, : self.hidden_size], self.weights.head()
        if self.weights.masked_embedding is not None:
            return self.weights.masked_embedding(hidden, head).float()
        return (hidden @ head.t()).float()


def load_assistant(
    model_dir: str | Path,
    target: nn.Module,
    store_layers: dict[str, int],
    dtype: torch.dtype,
    device: torch.device | str,
    max_positions: int,
    weights: WeightFormat | None = None,
) -> Gemma4Assistant:
    """The drafter in ``model_dir`` over ``target``, computing in ``dtype`` on
    ``device``, its linears in ``weights`` (default: the compute dtype)."""
    model_dir = Path(model_dir)
    config = assistant_config(json.loads((model_dir / "config.json").read_text()))
    files = weight_files(model_dir)
    fmt = weights or WeightFormat.of(dtype)
    with building(torch_dtype(fmt.name) if not fmt.quantized else dtype, "meta"):
        made = AssistantWeights(config, max_positions)
    made = fill(made, files, fmt, dtype, device, select=lambda name: name not in BUFFERS)
    if config.use_ordered_embeddings:
        made.masked_embedding.token_ordering.copy_(_token_ordering(files, config))
    return Gemma4Assistant(made, target, store_layers)


def _token_ordering(files: list[Path], config: AssistantConfig) -> torch.Tensor:
    """``masked_embedding.token_ordering``, checked: every token id once."""
    name = BUFFERS[0]
    for path, names in checkpoint_names(files).items():
        if name in names:
            with safe_open(str(path), framework="pt", device="cpu") as reader:
                ordering = reader.get_tensor(name).long()
            break
    else:
        raise ValueError(f"{name} is missing from {', '.join(f.name for f in files)}")
    if ordering.shape != (config.vocab_size,) or not torch.equal(
        ordering.sort().values, torch.arange(config.vocab_size)
    ):
        raise ValueError(
            f"{name} must list each of the {config.vocab_size} token ids once, got a tensor "
            f"of shape {tuple(ordering.shape)}"
        )
    return ordering
