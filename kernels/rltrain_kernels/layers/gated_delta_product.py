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

from .base import DeltaRuleLayer, sequence_parallel_op
from .chunked import chunked_gated_delta_product
from .common import LinearAttentionCache
from .recurrence import recurrent_gated_delta_product

torch_chunk_gated_delta_product = chunked_gated_delta_product
torch_recurrent_gated_delta_product = recurrent_gated_delta_product


class GatedDeltaProduct(DeltaRuleLayer):
    """forward(hidden_states [B, T, hidden_size], attention_mask [B, L ≥ T] or None, cache, use_cache, cu_seqlens,
    sequence_parallel) -> (output [B, T, hidden_size], LinearAttentionCache or None). See the module docstring and
    layers/common.py for the padding and packing rules, layers/base.py for sequence parallelism."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, num_householder: int = 2,
                 head_v_dim: int | None = None, conv_size: int = 4, allow_neg_eigval: bool = True,
                 norm_eps: float = 1e-6):
        if num_householder < 1:
            raise ValueError(f"num_householder must be >= 1, got {num_householder}")
        super().__init__(hidden_size, num_heads, head_dim, head_v_dim, allow_neg_eigval, norm_eps,
                         substeps=num_householder)
        self.num_householder = num_householder
        self.b_proj = nn.Linear(hidden_size, num_householder * num_heads, bias=False)  # β per sub-step
        self.a_proj = nn.Linear(hidden_size, num_heads, bias=False)                    # decay rate per token
        self.init_convs_and_output(conv_size, substeps=num_householder, decay=True)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                cache: LinearAttentionCache | None = None, use_cache: bool = False,
                cu_seqlens: torch.Tensor | None = None, sequence_parallel=None):
        B, T, _ = hidden_states.shape
        H, K, V, n_h = self.num_heads, self.head_k_dim, self.head_v_dim, self.num_householder
        x, mask, q, k, v, conv_states = self.convolved_inputs(hidden_states, attention_mask, cache, use_cache,
                                                              cu_seqlens, sequence_parallel)
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
        if sequence_parallel is not None:   # every token of this rank's heads (layers/base.py)
            op = sequence_parallel_op(op, sequence_parallel)
        o, state = op(q, k, v, g, beta, n_h, initial_state=None if cache is None else cache.recurrent_state,
                      output_final_state=use_cache, cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True)
        return self.gated_output_and_cache(o, x, mask, cache, use_cache, conv_states, state)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, head_k_dim={self.head_k_dim}, "
                f"head_v_dim={self.head_v_dim}, num_householder={self.num_householder}, "
                f"allow_neg_eigval={self.allow_neg_eigval}")
