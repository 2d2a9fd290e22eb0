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

import torch
import torch.nn as nn
import torch.nn.functional as F

from .base import DeltaRuleLayer, sequence_parallel_op
from .common import LinearAttentionCache
from .chunked import chunked_gated_delta_rule
from .recurrence import recurrent_gated_delta_rule

torch_chunk_gated_delta_rule = chunked_gated_delta_rule
torch_recurrent_gated_delta_rule = recurrent_gated_delta_rule


class GatedDeltaNet(DeltaRuleLayer):
    """forward(hidden_states [B, T, hidden_size], attention_mask [B, L ≥ T] or None, cache, use_cache, cu_seqlens,
    sequence_parallel) -> (output [B, T, hidden_size], LinearAttentionCache or None). See the module docstring and
    layers/common.py for the padding and packing rules, layers/base.py for sequence parallelism."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, head_v_dim: int | None = None,
                 conv_size: int = 4, allow_neg_eigval: bool = False, norm_eps: float = 1e-6):
        super().__init__(hidden_size, num_heads, head_dim, head_v_dim, allow_neg_eigval, norm_eps)
        self.b_proj = nn.Linear(hidden_size, num_heads, bias=False)  # β per head
        self.a_proj = nn.Linear(hidden_size, num_heads, bias=False)  # decay rate per head
        self.init_convs_and_output(conv_size, decay=True)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                cache: LinearAttentionCache | None = None, use_cache: bool = False,
                cu_seqlens: torch.Tensor | None = None, sequence_parallel=None):
        B, T, _ = hidden_states.shape
        H, K, V = self.num_heads, self.head_k_dim, self.head_v_dim
        x, mask, q, k, v, conv_states = self.convolved_inputs(hidden_states, attention_mask, cache, use_cache,
                                                              cu_seqlens, sequence_parallel)
        beta = self.b_proj(x).float().sigmoid()
        if self.allow_neg_eigval:
            beta = beta * 2.0
        g = -self.A_log.float().exp() * F.softplus(self.a_proj(x).float() + self.dt_bias)
        if mask is not None:  # padded tokens: identity update (no decay, β = 0)
            beta, g = beta * mask, g * mask
        op = torch_chunk_gated_delta_rule if cache is None else torch_recurrent_gated_delta_rule
        if sequence_parallel is not None:   # every token of this rank's heads (layers/base.py)
            op = sequence_parallel_op(op, sequence_parallel)
        o, state = op(q.reshape(B, T, H, K), k.reshape(B, T, H, K), v.reshape(B, T, H, V), g=g, beta=beta,
                      initial_state=None if cache is None else cache.recurrent_state, output_final_state=use_cache,
                      use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens)
        return self.gated_output_and_cache(o, x, mask, cache, use_cache, conv_states, state)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, head_k_dim={self.head_k_dim}, "
                f"head_v_dim={self.head_v_dim}, allow_neg_eigval={self.allow_neg_eigval}")
