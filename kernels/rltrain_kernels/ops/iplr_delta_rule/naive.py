"""The IPLR (identity plus low rank) delta rule in plain PyTorch, token by token: the readable ground truth the
kernels are tested against.

    S_t = S_{t−1} + b_t (a_tᵀ S_{t−1}) + k_t v_tᵀ,    o_t = S_tᵀ (scale · q_t)

computed in fp32 (float64 when the inputs are float64, which the gradient tests use); differentiable through
autograd. See README.md for the maths, the stable regime and the chunked form.
"""

from __future__ import annotations

import torch

from ..common.inputs import sequence_bounds
from .inputs import check_inputs


def naive_recurrent_iplr_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Reference IPLR delta rule.

    q, k, a, b: [B, T, H, K]; v: [B, T, H, V]; initial_state: [N, H, K, V]; cu_seqlens: [N+1] with B = 1.
    Returns o [B, T, H, V] in v's dtype and the final state [N, H, K, V] (fp32, or float64 for float64 inputs)
    when output_final_state, else None.
    """
    _, scale = check_inputs(q, k, v, a, b, scale, initial_state, cu_seqlens)
    B, T, H, K = q.shape
    V = v.shape[-1]
    acc = torch.float64 if v.dtype == torch.float64 else torch.float32
    qf, kf, af, bf = (x.to(acc).reshape(B * T, H, K) for x in (q, k, a, b))
    qf = qf * scale
    vf = v.to(acc).reshape(B * T, H, V)
    outputs, finals = [], []
    for n, (start, end) in enumerate(sequence_bounds(B, T, cu_seqlens)):
        if initial_state is not None:
            state = initial_state[n].to(acc)
        else:
            state = torch.zeros(H, K, V, dtype=acc, device=q.device)
        for t in range(start, end):
            read = torch.einsum("hkv,hk->hv", state, af[t])  # a_tᵀ S_{t−1}, before this token's write
            state = state + bf[t][:, :, None] * read[:, None, :] + kf[t][:, :, None] * vf[t][:, None, :]
            outputs.append(torch.einsum("hkv,hk->hv", state, qf[t]))
        finals.append(state)
    o = torch.stack(outputs, 0).reshape(B, T, H, V).to(v.dtype) if outputs else v.new_zeros(B, T, H, V)
    final_state = torch.stack(finals, 0) if output_final_state else None
    return o, final_state
