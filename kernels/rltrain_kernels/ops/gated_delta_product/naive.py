"""The gated delta product in plain PyTorch, token by token and sub-step by sub-step: the readable ground truth
the kernels are tested against.

    S ← exp(g_t) S;   for j = 1..n_h:  S ← S + β_{t,j} k_{t,j} (v_{t,j} − Sᵀ k_{t,j})ᵀ;   o_t = Sᵀ (scale · q_t)

computed in fp32 (float64 when the inputs are float64, which the gradient tests use); differentiable through
autograd. See README.md for the layout and the chunked form.
"""

from __future__ import annotations

import torch

from ..common.inputs import sequence_bounds
from ..l2norm import naive_l2norm
from .inputs import check_inputs


def naive_recurrent_gated_delta_product(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor,
    num_householder: int,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Reference gated delta product.

    q: [B, T, H, K]; k: [B, T·n_h, H, K]; v: [B, T·n_h, HV, V]; beta: [B, T·n_h, HV] (row t·n_h + j is sub-step
    j of token t); g (log gate, ≤ 0): [B, T, HV] or None (no decay); initial_state: [N, HV, K, V]; cu_seqlens:
    [N+1] token offsets of q with B = 1. Returns o [B, T, HV, V] in v's dtype and the final state [N, HV, K, V]
    (fp32, or float64 for float64 inputs) when output_final_state, else None.
    """
    N, group, scale = check_inputs(q, k, v, g, beta, num_householder, scale, initial_state, cu_seqlens)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    n_h = num_householder
    acc = torch.float64 if v.dtype == torch.float64 else torch.float32
    if use_qk_l2norm_in_kernel:
        q, k = naive_l2norm(q), naive_l2norm(k)
    # Flatten the batch into one token axis (sub-steps: rows t·n_h + j) and expand q/k to the value heads (GVA).
    qf = q.to(acc).reshape(B * T, H, K).repeat_interleave(group, dim=1) * scale
    kf = k.to(acc).reshape(B * T * n_h, H, K).repeat_interleave(group, dim=1)
    vf, bf = v.to(acc).reshape(B * T * n_h, HV, V), beta.to(acc).reshape(B * T * n_h, HV)
    gf = g.to(acc).reshape(B * T, HV) if g is not None else None
    outputs, finals = [], []
    for n, (start, end) in enumerate(sequence_bounds(B, T, cu_seqlens)):
        if initial_state is not None:
            state = initial_state[n].to(acc)
        else:
            state = torch.zeros(HV, K, V, dtype=acc, device=q.device)
        for t in range(start, end):
            if gf is not None:
                state = state * gf[t].exp()[:, None, None]
            for r in range(t * n_h, (t + 1) * n_h):
                # v − Sᵀ k: what the current state is missing for key k (one Householder step).
                delta = (vf[r] - torch.einsum("hkv,hk->hv", state, kf[r])) * bf[r][:, None]
                state = state + kf[r][:, :, None] * delta[:, None, :]
            outputs.append(torch.einsum("hkv,hk->hv", state, qf[t]))
        finals.append(state)
    o = torch.stack(outputs, 0).reshape(B, T, HV, V).to(v.dtype) if outputs else v.new_zeros(B, T, HV, V)
    final_state = torch.stack(finals, 0) if output_final_state else None
    return o, final_state
