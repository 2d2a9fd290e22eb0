"""IPLRLinearAttention: an identity-plus-low-rank (IPLR) delta-rule token mixer for policy models, on rltrain's
IPLR ops (S_t = S_{t−1} + b_t (a_tᵀ S_{t−1}) + k_t v_tᵀ, o_t = S_tᵀ (scale · q_t)).

Per token: q, k, v projections → short causal depthwise conv (kernel 4) + SiLU → l2-normalised q, k; the erase
direction from its own projection, â = l2norm(a_proj(x)), and a strength β = sigmoid(b_proj(x)) per head
(× 2 with allow_neg_eigval), giving

    a = â,   b = −β â         (b = λ a with λ = −β: the transition I + b aᵀ = I − β â âᵀ)

Why this parametrisation: I − β â âᵀ is symmetric with eigenvalues 1 (K − 1 times) and 1 − β ∈ [1 − β_max, 1),
so whatever the projections learn, no step can amplify the state (spectral norm ≤ 1 for β ≤ 2, the stable regime
λ‖a‖² ∈ [−2, 0] of ops/iplr_delta_rule); unconstrained a, b would let a single token blow the state up
(‖I + b aᵀ‖ unbounded), the usual source of divergence in linear-attention training. β > 1 (allow_neg_eigval)
reflects along â (negative eigenvalue), which delta-rule models need for state tracking. Writes k vᵀ use the unit
key k̂, so each token adds at most ‖v‖; the output's gated RMSNorm is invariant to the state's overall scale.
Erase (â) and write (k̂) directions are separate projections: with â = k̂ and k = β k̂ this is DeltaNet.

The delta rule runs through two module-level names, by role: `torch_chunk_iplr_delta_rule` for whole sequences
(training, prefill; packed rows through `cu_seqlens`) and `torch_recurrent_iplr_delta_rule` when continuing from a
cache (decoding one or more tokens from the cached conv and recurrent states): here the chunked plain-PyTorch form
(layers/chunked.py) and the per-step recurrence (layers/recurrence.py); the registry's `iplr_delta_rule` kernel runs
a copy of forward with them bound to `chunk_iplr_delta_rule` and `fused_recurrent_iplr_delta_rule`
(integrations/iplr_delta_rule.py).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .base import DeltaRuleLayer, sequence_parallel_op
from .chunked import chunked_iplr_delta_rule
from .common import LinearAttentionCache, l2norm
from .recurrence import recurrent_iplr_delta_rule

torch_chunk_iplr_delta_rule = chunked_iplr_delta_rule
torch_recurrent_iplr_delta_rule = recurrent_iplr_delta_rule


class IPLRLinearAttention(DeltaRuleLayer):
    """forward(hidden_states [B, T, hidden_size], attention_mask [B, L ≥ T] or None, cache, use_cache, cu_seqlens,
    sequence_parallel) -> (output [B, T, hidden_size], LinearAttentionCache or None). See the module docstring and
    layers/common.py for the padding and packing rules, layers/base.py for sequence parallelism."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, head_v_dim: int | None = None,
                 conv_size: int = 4, allow_neg_eigval: bool = True, norm_eps: float = 1e-6):
        super().__init__(hidden_size, num_heads, head_dim, head_v_dim, allow_neg_eigval, norm_eps)
        self.a_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False)  # erase direction â
        self.b_proj = nn.Linear(hidden_size, num_heads, bias=False)             # erase strength β per head
        self.init_convs_and_output(conv_size)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                cache: LinearAttentionCache | None = None, use_cache: bool = False,
                cu_seqlens: torch.Tensor | None = None, sequence_parallel=None):
        B, T, _ = hidden_states.shape
        H, K, V = self.num_heads, self.head_k_dim, self.head_v_dim
        x, mask, q, k, v, conv_states = self.convolved_inputs(hidden_states, attention_mask, cache, use_cache,
                                                              cu_seqlens, sequence_parallel)
        q, k = l2norm(q.reshape(B, T, H, K)), l2norm(k.reshape(B, T, H, K))
        v = v.reshape(B, T, H, V)
        a, b = self.erase_vectors(x, mask)
        if mask is not None:  # padded tokens: identity update (no erase above, no write here)
            k = k * mask[..., None].to(k.dtype)
        op = torch_chunk_iplr_delta_rule if cache is None else torch_recurrent_iplr_delta_rule
        if sequence_parallel is not None:   # every token of this rank's heads (layers/base.py)
            op = sequence_parallel_op(op, sequence_parallel)
        o, state = op(q, k, v, a, b, initial_state=None if cache is None else cache.recurrent_state,
                      output_final_state=use_cache, cu_seqlens=cu_seqlens)
        return self.gated_output_and_cache(o, x, mask, cache, use_cache, conv_states, state)

    def erase_vectors(self, x: torch.Tensor, mask: torch.Tensor | None = None):
        """(a, b) [B, T, H, K] of the transition I + b aᵀ: a = â = l2norm(a_proj(x)), b = −β â with β = sigmoid
        (× 2 with allow_neg_eigval), β = 0 where mask [B, T, 1] is 0."""
        B, T, _ = x.shape
        a = l2norm(self.a_proj(x).reshape(B, T, self.num_heads, self.head_k_dim))
        beta = self.b_proj(x).float().sigmoid()
        if self.allow_neg_eigval:
            beta = beta * 2.0
        if mask is not None:
            beta = beta * mask
        return a, (-beta[..., None] * a.float()).to(a.dtype)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, head_k_dim={self.head_k_dim}, "
                f"head_v_dim={self.head_v_dim}, allow_neg_eigval={self.allow_neg_eigval}")
