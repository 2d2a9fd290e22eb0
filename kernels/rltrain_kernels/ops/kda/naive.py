"""Kimi Delta Attention in plain PyTorch, token by token: the readable ground truth the kernels are tested against.

    S_t = (I − β_t k_t k_tᵀ) Diag(exp(g_t)) S_{t−1} + β_t k_t v_tᵀ,    o_t = S_tᵀ (scale · q_t)

with g_t ∈ ℝ^K a log decay per key channel (fla's naive_recurrent_kda: decay first, then the delta update of the
decayed state), computed in fp32 (float64 when the inputs are float64, which the gradient tests use);
differentiable through autograd. fla's keywords are read here too, in plain torch ops: use_gate_in_kernel (g holds
the raw a of g = −exp(A_log) softplus(a + dt_bias), `naive_kda_gate`), use_beta_sigmoid_in_kernel (β = sigmoid(beta),
2·sigmoid with allow_neg_eigval) and state_v_first (states stored [N, HV, V, K]). README.md has the chunked form.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..common.inputs import resolve_state_v_first, sequence_bounds
from ..l2norm import naive_l2norm
from .inputs import check_inputs, check_preprocess


def naive_kda_gate(a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None = None) -> torch.Tensor:
    """g = −exp(A_log[h]) · softplus(a + dt_bias[h, :]) for a [..., HV, K], A_log [HV], dt_bias [HV·K]: fla's
    fused_kda_gate, in fp32 (float64 for float64 a)."""
    HV, K = a.shape[-2:]
    acc = torch.float64 if torch.float64 in (a.dtype, A_log.dtype) else torch.float32
    x = a.to(acc)
    if dt_bias is not None:
        x = x + dt_bias.to(acc).reshape(HV, K)
    return -A_log.to(acc).reshape(HV, 1).exp() * F.softplus(x)


def naive_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    *,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    transpose_state_layout: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Reference KDA.

    q, k: [B, T, H, K]; v: [B, T, HV, V] (HV a multiple of H: value head hv reads q/k head hv // (HV/H));
    g (log decay per key channel, ≤ 0): [B, T, HV, K]; beta: [B, T, HV]; initial_state: [N, HV, K, V];
    cu_seqlens: [N+1] with B = 1. fla's keywords as chunk_kda's docstring.
    Returns o [B, T, HV, V] in v's dtype and the final state [N, HV, K, V] (fp32, or float64 for float64 inputs)
    when output_final_state, else None.
    """
    state_v_first = resolve_state_v_first(state_v_first, transpose_state_layout)
    N, group, scale = check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first)
    pre = check_preprocess(g, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    acc = torch.float64 if v.dtype == torch.float64 else torch.float32
    if use_qk_l2norm_in_kernel:
        q, k = naive_l2norm(q), naive_l2norm(k)
    if pre.gate is not None:
        g = naive_kda_gate(g, *pre.gate)
    if pre.beta_scale:
        beta = pre.beta_scale * torch.sigmoid(beta.to(acc))
    if state_v_first and initial_state is not None:
        initial_state = initial_state.transpose(-1, -2)
    qf = q.to(acc).reshape(B * T, H, K).repeat_interleave(group, dim=1) * scale
    kf = k.to(acc).reshape(B * T, H, K).repeat_interleave(group, dim=1)
    vf, gf, bf = v.to(acc).reshape(B * T, HV, V), g.to(acc).reshape(B * T, HV, K), beta.to(acc).reshape(B * T, HV)
    outputs, finals = [], []
    for n, (start, end) in enumerate(sequence_bounds(B, T, cu_seqlens)):
        if initial_state is not None:
            state = initial_state[n].to(acc)
        else:
            state = torch.zeros(HV, K, V, dtype=acc, device=q.device)
        for t in range(start, end):
            k_t, v_t, b_t = kf[t], vf[t], bf[t]  # [HV, K], [HV, V], [HV]
            state = state * gf[t].exp()[:, :, None]  # each key channel's row of the state decays by its own gate
            delta = (v_t - torch.einsum("hkv,hk->hv", state, k_t)) * b_t[:, None]
            state = state + k_t[:, :, None] * delta[:, None, :]
            outputs.append(torch.einsum("hkv,hk->hv", state, qf[t]))
        finals.append(state)
    o = torch.stack(outputs, 0).reshape(B, T, HV, V).to(v.dtype) if outputs else v.new_zeros(B, T, HV, V)
    final_state = torch.stack(finals, 0) if output_final_state else None
    if state_v_first and final_state is not None:
        final_state = final_state.transpose(-1, -2).contiguous()
    return o, final_state
