"""GatedDeltaProduct: a Gated DeltaProduct token mixer (Siems et al. 2025; fla's layer of the same name) for policy
models, on rltrain's gated delta product ops.

Per token: q, k, v projections (k, v with n_h sub-steps each) → short causal depthwise conv (kernel 4) + SiLU →
l2-normalised q, k (in the op) → n_h Householder steps per token with β = sigmoid(·) (× 2 with allow_neg_eigval:
eigenvalues of I − β k kᵀ in [−1, 1], the state-tracking regime DeltaProduct is built for) and one decay per token,
g = −exp(A_log) · softplus(a_proj(x) + dt_bias) (Mamba2 / Gated DeltaNet's parametrisation) → per-head gated
RMSNorm with an output gate → output projection.

The delta product runs through two module-level names, by role: `torch_chunk_gated_delta_product` for whole
sequences (training, prefill; packed rows through `cu_seqlens`) and `torch_recurrent_gated_delta_product` when
continuing from a cache (decoding one or more tokens from the cached conv and recurrent states): here the chunked
plain-PyTorch form (layers/chunked.py) and the per-step recurrence (layers/recurrence.py); the registry's
`gated_delta_product` kernel runs a copy of forward with them bound to `chunk_gated_delta_product` and
`fused_recurrent_gated_delta_product` (integrations/gated_delta_product.py).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .common import LinearAttentionCache, ShortConvolution, check_packed_call, gated_output, padding_mask
from .gated_delta_rule import decay_parameters
from .chunked import chunked_gated_delta_product
from .recurrence import recurrent_gated_delta_product

torch_chunk_gated_delta_product = chunked_gated_delta_product
torch_recurrent_gated_delta_product = recurrent_gated_delta_product


class GatedDeltaProduct(nn.Module):
    """forward(hidden_states [B, T, hidden_size], attention_mask [B, L ≥ T] or None, cache, use_cache, cu_seqlens)
    -> (output [B, T, hidden_size], LinearAttentionCache or None). See the module docstring and layers/common.py for
    the padding and packing rules."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, num_householder: int = 2,
                 head_v_dim: int | None = None, conv_size: int = 4, allow_neg_eigval: bool = True,
                 norm_eps: float = 1e-6):
        super().__init__()
        if min(hidden_size, num_heads, head_dim, num_householder) < 1:
            raise ValueError("hidden_size, num_heads, head_dim and num_householder must be >= 1")
        self.hidden_size, self.num_heads, self.num_householder = hidden_size, num_heads, num_householder
        self.head_k_dim, self.head_v_dim = head_dim, head_v_dim or head_dim
        self.allow_neg_eigval, self.norm_eps = allow_neg_eigval, norm_eps
        H, K, V, n_h = num_heads, self.head_k_dim, self.head_v_dim, num_householder
        # Bias-free projections: a zeroed (padded) hidden state then gives zero conv inputs and a zero output gate.
        self.q_proj = nn.Linear(hidden_size, H * K, bias=False)
        self.k_proj = nn.Linear(hidden_size, n_h * H * K, bias=False)
        self.v_proj = nn.Linear(hidden_size, n_h * H * V, bias=False)
        self.b_proj = nn.Linear(hidden_size, n_h * H, bias=False)  # β per sub-step
        self.a_proj = nn.Linear(hidden_size, H, bias=False)        # decay rate per token
        self.g_proj = nn.Linear(hidden_size, H * V, bias=False)    # output gate
        self.q_conv = ShortConvolution(H * K, conv_size)
        self.k_conv = ShortConvolution(n_h * H * K, conv_size)
        self.v_conv = ShortConvolution(n_h * H * V, conv_size)
        A_log, dt_bias = decay_parameters(H)
        self.A_log, self.dt_bias = nn.Parameter(A_log), nn.Parameter(dt_bias)
        self.norm_weight = nn.Parameter(torch.ones(V))
        self.o_proj = nn.Linear(H * V, hidden_size, bias=False)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                cache: LinearAttentionCache | None = None, use_cache: bool = False,
                cu_seqlens: torch.Tensor | None = None):
        B, T, _ = hidden_states.shape
        H, K, V, n_h = self.num_heads, self.head_k_dim, self.head_v_dim, self.num_householder
        check_packed_call(cu_seqlens, B, attention_mask, cache, use_cache)
        mask = padding_mask(attention_mask, B, T, cache, use_cache)
        x = hidden_states if mask is None else hidden_states * mask.to(hidden_states.dtype)
        conv_states = cache.conv_states if cache is not None else {}
        q, q_state = self.q_conv(self.q_proj(x), conv_states.get("q"), cu_seqlens)
        k, k_state = self.k_conv(self.k_proj(x), conv_states.get("k"), cu_seqlens)
        v, v_state = self.v_conv(self.v_proj(x), conv_states.get("v"), cu_seqlens)
        q = q.reshape(B, T, H, K)
        k = k.reshape(B, T * n_h, H, K)  # channels (n_h, H, K): sub-step j of token t is row t·n_h + j
        v = v.reshape(B, T * n_h, H, V)
        beta = self.b_proj(x).float().sigmoid()
        if self.allow_neg_eigval:
            beta = beta * 2.0
        g = -self.A_log.float().exp() * F.softplus(self.a_proj(x).float() + self.dt_bias)
        if mask is not None:  # padded tokens: identity update (no decay, β = 0)
            beta = beta * mask  # [B, T, n_h·H] × [B, T, 1]
            g = g * mask
        beta = beta.reshape(B, T * n_h, H)
        op = torch_chunk_gated_delta_product if cache is None else torch_recurrent_gated_delta_product
        o, state = op(q, k, v, g, beta, n_h, initial_state=None if cache is None else cache.recurrent_state,
                      output_final_state=use_cache, cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True)
        out = self.o_proj(gated_output(o, self.g_proj(x), self.norm_weight, self.norm_eps))
        if mask is not None:
            out = out * mask.to(out.dtype)
        if not use_cache:
            return out, None
        seen = (cache.seen_tokens if cache is not None else 0) + T
        return out, LinearAttentionCache({"q": q_state, "k": k_state, "v": v_state}, state, seen)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, head_k_dim={self.head_k_dim}, "
                f"head_v_dim={self.head_v_dim}, num_householder={self.num_householder}, "
                f"allow_neg_eigval={self.allow_neg_eigval}")
