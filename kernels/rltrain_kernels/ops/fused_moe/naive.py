"""Plain-PyTorch mixture-of-experts MLP: the per-expert loop transformers' Qwen3-MoE / Mixtral experts run, the ground
truth the Triton kernels are tested against, and the CPU fallback.

Each token t goes to the k experts top_k_index[t] with weights top_k_weights[t]; expert e is the SwiGLU MLP
down_e(silu(gate_e(x)) * up_e(x)) with gate_e / up_e the two halves of gate_up_proj[e] ([2I, H]: gate rows first,
transformers' concatenated layout) and down_e = down_proj[e] ([H, I]):

    out[t] = Σ_j top_k_weights[t, j] · down_{e_j}(silu(gate_{e_j}(x_t)) * up_{e_j}(x_t)),   e_j = top_k_index[t, j]

The maths runs in fp32 (float64 stays float64) and the result is cast back to hidden_states' dtype, so the reference
is the more accurate of the two where transformers rounds each product to bf16. Differentiable in everything but
top_k_index through autograd; an expert no token picks gets a zero gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def naive_fused_moe(hidden_states: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                    top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """out [..., H] (hidden_states' shape and dtype) from hidden_states [..., H], gate_up_proj [E, 2I, H],
    down_proj [E, H, I], top_k_index [..., k] (integers in [0, E)) and top_k_weights [..., k]."""
    compute = torch.float64 if hidden_states.dtype == torch.float64 else torch.float32
    hidden = hidden_states.shape[-1]
    x = hidden_states.reshape(-1, hidden).to(compute)
    index = top_k_index.reshape(x.shape[0], -1)
    weights = top_k_weights.reshape(index.shape).to(compute)
    intermediate = down_proj.shape[-1]
    out = torch.zeros_like(x)
    for expert in index.unique().tolist():
        token, slot = torch.where(index == expert)
        gate, up = (x[token] @ gate_up_proj[expert].to(compute).T).split(intermediate, dim=-1)
        y = (F.silu(gate) * up) @ down_proj[expert].to(compute).T
        out.index_add_(0, token, y * weights[token, slot, None])
    return out.to(hidden_states.dtype).reshape(hidden_states.shape)
