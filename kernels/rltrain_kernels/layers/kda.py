"""KimiDeltaAttention: a Kimi Delta Attention token mixer (Kimi Linear's linear-attention layer, fla's layer of the
same name) for policy models, on rltrain's KDA ops.

Per token: q, k, v projections → short causal depthwise conv (kernel 4) + SiLU → l2-normalised q, k (in the op) →
one delta-rule step with a decay per key channel, S ← (I − β k kᵀ) Diag(e^g) S + β k vᵀ, β = sigmoid(·) (× 2 with
allow_neg_eigval) and g = −exp(A_log) · softplus(f_proj(x) + dt_bias) per head and key channel (f_proj a low-rank
pair of projections, hidden → head_v_dim → H·K, as fla's) → per-head gated RMSNorm with an output gate → output
projection. Where Gated DeltaNet forgets a whole head at once, each key channel here keeps its own memory span.

The delta rule runs through two module-level names, by role: `torch_chunk_kda` for whole sequences (training,
prefill; packed rows through `cu_seqlens`) and `torch_recurrent_kda` when continuing from a cache (decoding): both
the per-step recurrence of layers/recurrence.py here; the registry's `kda` kernel runs a copy of forward with them
bound to `chunk_kda` and `fused_recurrent_kda` (integrations/kda.py).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .base import DeltaRuleLayer, decay_parameters, sequence_parallel_op
from .common import LinearAttentionCache
from .recurrence import recurrent_kda

torch_chunk_kda = recurrent_kda
torch_recurrent_kda = recurrent_kda


class KimiDeltaAttention(DeltaRuleLayer):
    """forward(hidden_states [B, T, hidden_size], attention_mask [B, L ≥ T] or None, cache, use_cache, cu_seqlens)
    -> (output [B, T, hidden_size], LinearAttentionCache or None). See the module docstring and layers/common.py for
    the padding and packing rules."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, head_v_dim: int | None = None,
                 conv_size: int = 4, allow_neg_eigval: bool = False, norm_eps: float = 1e-6):
        super().__init__(hidden_size, num_heads, head_dim, head_v_dim, allow_neg_eigval, norm_eps)
        self.b_proj = nn.Linear(hidden_size, num_heads, bias=False)  # β per head
        self.f_proj = nn.Sequential(nn.Linear(hidden_size, self.head_v_dim, bias=False),  # decay rate per channel
                                    nn.Linear(self.head_v_dim, num_heads * head_dim, bias=False))
        self.init_convs_and_output(conv_size)
        A_log, dt_bias = decay_parameters(num_heads, num_heads * head_dim)  # a dt per key channel
        self.A_log, self.dt_bias = nn.Parameter(A_log), nn.Parameter(dt_bias)

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
        g = -self.A_log.float().exp()[:, None] * F.softplus(self.f_proj(x).float().view(B, T, H, K)
                                                            + self.dt_bias.view(H, K))
        if mask is not None:  # padded tokens: identity update (no decay, β = 0)
            beta, g = beta * mask, g * mask[..., None]
        op = torch_chunk_kda if cache is None else torch_recurrent_kda
        if sequence_parallel is not None:   # every token of this rank's heads (layers/base.py)
            op = sequence_parallel_op(op, sequence_parallel)
        o, state = op(q.reshape(B, T, H, K), k.reshape(B, T, H, K), v.reshape(B, T, H, V), g=g, beta=beta,
                      initial_state=None if cache is None else cache.recurrent_state, output_final_state=use_cache,
                      use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens)
        return self.gated_output_and_cache(o, x, mask, cache, use_cache, conv_states, state)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, head_k_dim={self.head_k_dim}, "
                f"head_v_dim={self.head_v_dim}, allow_neg_eigval={self.allow_neg_eigval}")
