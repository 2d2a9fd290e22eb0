"""GatedDeltaNet: a Gated DeltaNet token mixer (Yang et al. 2025; the linear-attention layer of Qwen3-Next, fla's
layer of the same name) for policy models, on the gated delta rule.

Per token: q, k, v projections → short causal depthwise conv (kernel 4) + SiLU → l2-normalised q, k (in the op) →
one delta-rule step S ← exp(g) (I − β k kᵀ) S + β k vᵀ with β = sigmoid(·) (× 2 with allow_neg_eigval: eigenvalues of
I − β k kᵀ in [−1, 1]) and the decay g = −exp(A_log) · softplus(a_proj(x) + dt_bias) (Mamba2 / Gated DeltaNet's
parametrisation) → per-head gated RMSNorm with an output gate → output projection. GatedDeltaProduct with
num_householder = 1 is the same maths with its own parameter names; this layer keeps Gated DeltaNet's shape.

The delta rule runs through two module-level names, by role: `torch_chunk_gated_delta_rule` for whole sequences
(training, prefill; packed rows through `cu_seqlens`) and `torch_recurrent_gated_delta_rule` when continuing from a
cache (decoding): here the chunked plain-PyTorch form (layers/chunked.py) and the per-step recurrence
(layers/recurrence.py); the registry's `gated_delta_rule` kernel runs a copy of forward with them bound to
`chunk_gated_delta_rule` and `fused_recurrent_gated_delta_rule` (integrations/gated_delta_rule.py: transformers'
names and argument order, so the one adapter serves this layer and Qwen3-Next's).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .common import LinearAttentionCache, ShortConvolution, check_packed_call, gated_output, padding_mask
from .chunked import chunked_gated_delta_rule
from .recurrence import recurrent_gated_delta_rule

torch_chunk_gated_delta_rule = chunked_gated_delta_rule
torch_recurrent_gated_delta_rule = recurrent_gated_delta_rule


def decay_parameters(num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(A_log, dt_bias) drawn as Gated DeltaNet draws them: A ~ U(1, 16), dt ~ logU(1e-3, 0.1) stored as
    softplus⁻¹(dt). Shared by the gated delta rule and product layers."""
    A_log = torch.empty(num_heads).uniform_(1, 16).log()
    dt = torch.exp(torch.rand(num_heads) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).clamp_min(1e-4)
    return A_log, dt + torch.log(-torch.expm1(-dt))


class GatedDeltaNet(nn.Module):
    """forward(hidden_states [B, T, hidden_size], attention_mask [B, L ≥ T] or None, cache, use_cache, cu_seqlens)
    -> (output [B, T, hidden_size], LinearAttentionCache or None). See the module docstring and layers/common.py for
    the padding and packing rules."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, head_v_dim: int | None = None,
                 conv_size: int = 4, allow_neg_eigval: bool = False, norm_eps: float = 1e-6):
        super().__init__()
        if min(hidden_size, num_heads, head_dim) < 1:
            raise ValueError("hidden_size, num_heads and head_dim must be >= 1")
        self.hidden_size, self.num_heads = hidden_size, num_heads
        self.head_k_dim, self.head_v_dim = head_dim, head_v_dim or head_dim
        self.allow_neg_eigval, self.norm_eps = allow_neg_eigval, norm_eps
        H, K, V = num_heads, self.head_k_dim, self.head_v_dim
        # Bias-free projections: a zeroed (padded) hidden state then gives zero conv inputs and a zero output gate.
        self.q_proj = nn.Linear(hidden_size, H * K, bias=False)
        self.k_proj = nn.Linear(hidden_size, H * K, bias=False)
        self.v_proj = nn.Linear(hidden_size, H * V, bias=False)
        self.b_proj = nn.Linear(hidden_size, H, bias=False)      # β per head
        self.a_proj = nn.Linear(hidden_size, H, bias=False)      # decay rate per head
        self.g_proj = nn.Linear(hidden_size, H * V, bias=False)  # output gate
        self.q_conv = ShortConvolution(H * K, conv_size)
        self.k_conv = ShortConvolution(H * K, conv_size)
        self.v_conv = ShortConvolution(H * V, conv_size)
        A_log, dt_bias = decay_parameters(H)
        self.A_log, self.dt_bias = nn.Parameter(A_log), nn.Parameter(dt_bias)
        self.norm_weight = nn.Parameter(torch.ones(V))
        self.o_proj = nn.Linear(H * V, hidden_size, bias=False)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                cache: LinearAttentionCache | None = None, use_cache: bool = False,
                cu_seqlens: torch.Tensor | None = None):
        B, T, _ = hidden_states.shape
        H, K, V = self.num_heads, self.head_k_dim, self.head_v_dim
        check_packed_call(cu_seqlens, B, attention_mask, cache, use_cache)
        mask = padding_mask(attention_mask, B, T, cache, use_cache)
        x = hidden_states if mask is None else hidden_states * mask.to(hidden_states.dtype)
        conv_states = cache.conv_states if cache is not None else {}
        q, q_state = self.q_conv(self.q_proj(x), conv_states.get("q"), cu_seqlens)
        k, k_state = self.k_conv(self.k_proj(x), conv_states.get("k"), cu_seqlens)
        v, v_state = self.v_conv(self.v_proj(x), conv_states.get("v"), cu_seqlens)
        beta = self.b_proj(x).float().sigmoid()
        if self.allow_neg_eigval:
            beta = beta * 2.0
        g = -self.A_log.float().exp() * F.softplus(self.a_proj(x).float() + self.dt_bias)
        if mask is not None:  # padded tokens: identity update (no decay, β = 0)
            beta, g = beta * mask, g * mask
        op = torch_chunk_gated_delta_rule if cache is None else torch_recurrent_gated_delta_rule
        o, state = op(q.reshape(B, T, H, K), k.reshape(B, T, H, K), v.reshape(B, T, H, V), g=g, beta=beta,
                      initial_state=None if cache is None else cache.recurrent_state, output_final_state=use_cache,
                      use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens)
        out = self.o_proj(gated_output(o, self.g_proj(x), self.norm_weight, self.norm_eps))
        if mask is not None:
            out = out * mask.to(out.dtype)
        if not use_cache:
            return out, None
        seen = (cache.seen_tokens if cache is not None else 0) + T
        return out, LinearAttentionCache({"q": q_state, "k": k_state, "v": v_state}, state, seen)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, head_k_dim={self.head_k_dim}, "
                f"head_v_dim={self.head_v_dim}, allow_neg_eigval={self.allow_neg_eigval}")
