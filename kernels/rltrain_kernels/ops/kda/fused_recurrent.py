"""Fused-recurrent KDA, forward: one Triton program per (sequence, value head, V block) walks the tokens with the fp32
state tile [K, BV] in registers. Built for decoding (T = 1 with the cache state in and out) and short sequences;
function.py's autograd Function runs its backward through the chunked kernels.

fla's keywords run inside the kernel, so a decoding step reads the raw inputs and the cache state once: the gate
−exp(A_log) softplus(a + dt_bias) per key channel (use_gate_in_kernel), β = sigmoid(beta) (·2 with
allow_neg_eigval), q and k l2-normalised, and the state in either layout (state_v_first: [N, HV, V, K] in memory, the
same [K, BV] tile in registers, read and written through transposed addresses).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.chunking import sequence_offsets
from ..common.cumsum import softplus


@triton.jit
def fused_recurrent_kda_fwd_kernel(
    q, k, v, g, beta, A_log, dt_bias, o, h0, ht, cu_seqlens, scale, beta_scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr, USE_QK_L2NORM: tl.constexpr,
    USE_GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr, BETA_SIGMOID: tl.constexpr, STATE_V_FIRST: tl.constexpr,
):
    NV: tl.constexpr = (V + BV - 1) // BV
    i_nh, i_v = tl.program_id(0) // NV, tl.program_id(0) % NV
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_h = m_k[:, None] & m_v[None, :]
    if STATE_V_FIRST:
        state_offset = (i_n * HV + i_hv).to(tl.int64) * K * V + o_v[None, :] * K + o_k[:, None]
    else:
        state_offset = (i_n * HV + i_hv).to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_INITIAL_STATE:
        b_h += tl.load(h0 + state_offset, mask=m_h, other=0.0).to(tl.float32)
    if USE_GATE:
        b_neg_A = -tl.exp(tl.load(A_log + i_hv).to(tl.float32))
        if HAS_DT_BIAS:
            b_bias = tl.load(dt_bias + i_hv * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    for t in range(bos, eos):
        b_q = tl.load(q + (t * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_k = tl.load(k + (t * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_v = tl.load(v + (t * HV + i_hv) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_g = tl.load(g + (t * HV + i_hv) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_beta = tl.load(beta + t * HV + i_hv).to(tl.float32)
        if USE_GATE:  # g holds the raw a
            if HAS_DT_BIAS:
                b_g += b_bias
            b_g = tl.where(m_k, b_neg_A * softplus(b_g), 0.0)
        if BETA_SIGMOID:
            b_beta = beta_scale * tl.sigmoid(b_beta)
        if USE_QK_L2NORM:
            b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6)
            b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
        b_h *= tl.exp(b_g)[:, None]  # each key channel's row decays by its own gate
        b_delta = b_beta * (b_v - tl.sum(b_h * b_k[:, None], 0))
        b_h += b_k[:, None] * b_delta[None, :]
        b_o = tl.sum(b_h * (b_q * scale)[:, None], 0)
        tl.store(o + (t * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
    if STORE_FINAL_STATE:
        tl.store(ht + state_offset, b_h, mask=m_h)


def fused_recurrent_kda_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                            use_qk_l2norm_in_kernel, gate=None, beta_scale: float = 0.0, state_v_first: bool = False):
    """Host function: one program per (V block, sequence × value head). gate: (A_log, dt_bias or None) when g is
    the raw a; beta_scale: β = beta_scale·sigmoid(beta), or 0 for β = beta; state_v_first: initial and final states
    [N, HV, V, K]."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    offsets = sequence_offsets(B, T, cu_seqlens, q.device)
    N = offsets.numel() - 1
    BK = triton.next_power_of_2(K)
    # 32 value columns at 2 warps: the gated delta rule's decode setting for its [K, V] tile (H200, B256 HV16
    # K=V=128; fused_recurrent.py there), not yet timed for KDA's extra [K] gate load per token.
    BV = min(triton.next_power_of_2(V), 32)
    o = torch.empty(B, T, HV, V, dtype=v.dtype, device=v.device)
    state_shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
    ht = torch.empty(state_shape, dtype=torch.float32, device=q.device) if output_final_state else None
    h0 = initial_state.contiguous() if initial_state is not None else None
    A_log, dt_bias = gate or (None, None)
    fused_recurrent_kda_fwd_kernel[(N * HV * triton.cdiv(V, BV),)](
        q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(),
        None if A_log is None else A_log.contiguous(), None if dt_bias is None else dt_bias.contiguous(),
        o, h0, ht, offsets, scale, float(beta_scale), H=H, HV=HV, K=K, V=V, BK=BK, BV=BV,
        USE_INITIAL_STATE=h0 is not None, STORE_FINAL_STATE=output_final_state,
        USE_QK_L2NORM=use_qk_l2norm_in_kernel, USE_GATE=A_log is not None, HAS_DT_BIAS=dt_bias is not None,
        BETA_SIGMOID=bool(beta_scale), STATE_V_FIRST=state_v_first, num_warps=2,
    )
    return o, ht
