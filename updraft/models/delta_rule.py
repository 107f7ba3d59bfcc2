"""The gated delta rule and the short causal convolution in front of it (Gated DeltaNet),
as pure functions over float32 tensors.

Per value head, the state S [key_dim, value_dim] is a fast-weight memory. Each token
decays it by exp(g) (g <= 0), reads what it predicts for the token's key, writes a
correction towards the token's value at rate beta, and answers its query from the
updated memory:

    S = exp(g) S;  S += k (beta (v - S^T k))^T;  out = S^T q

``recurrent_step`` is that, one token of every request at once: what decodes and
verify steps run, inside captured graphs too (fixed shapes, no host sync).
``chunked`` is the same recurrence in blocks of ``CHUNK`` tokens for one long query:
within a block the corrections are one triangular solve (the WY form of a product of
rank-one updates), and only the state at block ends is formed. The two agree to
rounding; the state a prefill leaves is the same state a decode would have.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Tokens per block of the chunked form.
CHUNK = 64
# As the reference kernels normalise queries and keys.
L2_EPS = 1e-6


def l2norm(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    """``x`` scaled to unit length along its last dimension (eps inside the root)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def causal_conv(
    x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A depthwise causal convolution and SiLU over tokens that follow ``window``.

    x [B, T, C]; window [B, C, K - 1], the channels of the K - 1 tokens before x, oldest
    first (zeros for a fresh request); weight [C, K]. Returns the output [B, T, C] and
    the window after x."""
    kernel = weight.shape[1]
    sequence = torch.cat([window, x.transpose(1, 2)], dim=2)
    # Each output is a dot product of K values: as a product and a sum over the
    # sequence's windows rather than a oneDNN convolution, which costs ~150 us for
    # one token and ends a captured graph's compiled run.
    out = (sequence.unfold(2, kernel, 1) * weight[:, None, :]).sum(dim=-1)
    return F.silu(out).transpose(1, 2), sequence[:, :, sequence.shape[2] - (kernel - 1) :]


def recurrent_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row: q, k [B, H, Dk] (normalised; q already scaled), v [B, H, Dv],
    g, beta [B, H], state [B, H, Dk, Dv] -> output [B, H, Dv] and the new state."""
    state = state * g.exp()[..., None, None]
    predicted = (state * k[..., None]).sum(dim=-2)
    correction = (v - predicted) * beta[..., None]
    state = state + k[..., None] * correction[..., None, :]
    return (state * q[..., None]).sum(dim=-2), state


def chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence over whole sequences: q, k [B, H, T, Dk], v [B, H, T, Dv], g, beta
    [B, H, T], state [B, H, Dk, Dv] -> outputs [B, H, T, Dv] and the final state.

    The sequence is padded to whole blocks with tokens that neither decay (g = 0) nor
    write (beta = 0, k = 0): the final state is the last real token's."""
    length = q.shape[2]
    pad = -length % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    batch, heads = q.shape[:2]
    blocks = (length + pad) // chunk
    q, k, v = (x.reshape(batch, heads, blocks, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = (x.reshape(batch, heads, blocks, chunk) for x in (g, beta))
    # Log-decay from the block's start through each token, and between token pairs
    # (token i sees token j's write decayed by exp(total_i - total_j), j <= i).
    total = g.cumsum(dim=-1)
    later = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    pair_decay = (total[..., :, None] - total[..., None, :]).masked_fill(later, float("-inf"))
    pair_decay = pair_decay.exp()
    k_beta = k * beta[..., None]
    # Each token's correction depends on the earlier tokens' corrections in its block
    # through (I + L), L strictly lower triangular: solved once for the values and for
    # the decayed keys that read the state the block starts from.
    system = (k_beta @ k.transpose(-1, -2)) * pair_decay
    values = torch.linalg.solve_triangular(
        system, v * beta[..., None], upper=False, unitriangular=True
    )
    keys_read = torch.linalg.solve_triangular(
        system, k_beta * total.exp()[..., None], upper=False, unitriangular=True
    )
    within = (q @ k.transpose(-1, -2)) * pair_decay
    q_decayed = q * total.exp()[..., None]
    last = total[..., -1:]
    k_to_end = k * (last - total).exp()[..., None]
    block_decay = last.exp()[..., None]  # [B, H, blocks, 1, 1]
    outputs = []
    for block in range(blocks):
        corrections = values[:, :, block] - keys_read[:, :, block] @ state
        outputs.append(q_decayed[:, :, block] @ state + within[:, :, block] @ corrections)
        state = (
            state * block_decay[:, :, block] + k_to_end[:, :, block].transpose(-1, -2) @ corrections
        )
    out = torch.stack(outputs, dim=2).reshape(batch, heads, blocks * chunk, -1)
    return out[:, :, :length], state
