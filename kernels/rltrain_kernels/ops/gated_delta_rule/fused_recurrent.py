"""Fused-recurrent gated delta rule, forward: one Triton program per (sequence, value head, V block) walks the tokens
with the fp32 state tile in registers. Built for decoding (T = 1 with the cache state in and out) and short
sequences; function.py's autograd Function runs its backward through the chunked kernels.

fla's keywords run inside the kernel, as fla's own does, so a decoding step reads the raw inputs and the cache state
once: the gate −exp(A_log) softplus(a + dt_bias) (use_gate_in_kernel), β = sigmoid(beta) (·2 with allow_neg_eigval)
and the state in the transposed layout [N, HV, V, K] (state_v_first: the tile in registers is [V, K] too, so each
program reads and writes BV whole rows of K contiguous values).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.chunking import sequence_offsets
from ..common.cumsum import softplus


@triton.jit
def fused_recurrent_gated_delta_rule_fwd_kernel(
    q, k, v, g, beta, A_log, dt_bias, o, h0, ht, cu_seqlens, scale, beta_scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr, USE_QK_L2NORM: tl.constexpr,
    USE_GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr, BETA_SIGMOID: tl.constexpr, STATE_V_FIRST: tl.constexpr,
):
    NV: tl.constexpr = (V + BV - 1) // BV
    i_nh, i_v = tl.program_id(0) // NV, tl.program_id(0) % NV  # one head's value blocks on consecutive programs
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k, mask_v = o_k < K, o_v < V
    # The register tile is S[k, v] as [BK, BV], or with state_v_first as [BV, BK] (the layout in memory).
    if STATE_V_FIRST:
        mask_h = mask_v[:, None] & mask_k[None, :]
        state_offset = (i_n * HV + i_hv).to(tl.int64) * K * V + o_v[:, None] * K + o_k[None, :]
        b_h = tl.zeros([BV, BK], dtype=tl.float32)
    else:
        mask_h = mask_k[:, None] & mask_v[None, :]
        state_offset = (i_n * HV + i_hv).to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]
        b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_GATE:
        b_neg_A = -tl.exp(tl.load(A_log + i_hv).to(tl.float32))
        if HAS_DT_BIAS:
            b_dt_bias = tl.load(dt_bias + i_hv).to(tl.float32)
    if USE_INITIAL_STATE:
        b_h += tl.load(h0 + state_offset, mask=mask_h, other=0.0).to(tl.float32)
    for t in range(bos, eos):
        b_q = tl.load(q + (t * H + i_h) * K + o_k, mask=mask_k, other=0.0).to(tl.float32)
        b_k = tl.load(k + (t * H + i_h) * K + o_k, mask=mask_k, other=0.0).to(tl.float32)
        b_v = tl.load(v + (t * HV + i_hv) * V + o_v, mask=mask_v, other=0.0).to(tl.float32)
        b_g = tl.load(g + t * HV + i_hv).to(tl.float32)
        b_beta = tl.load(beta + t * HV + i_hv).to(tl.float32)
        if USE_GATE:  # g holds the raw a: g = −exp(A_log) softplus(a + dt_bias)
            if HAS_DT_BIAS:
                b_g += b_dt_bias
            b_g = b_neg_A * softplus(b_g)
        if BETA_SIGMOID:  # beta holds logits
            b_beta = beta_scale * tl.sigmoid(b_beta)
        if USE_QK_L2NORM:
            b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6)
            b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
        b_h *= tl.exp(b_g)
        # delta = β (v − Sᵀ k): what the decayed state is missing for key k; then S += k deltaᵀ, o = Sᵀ q.
        if STATE_V_FIRST:
            b_delta = b_beta * (b_v - tl.sum(b_h * b_k[None, :], 1))
            b_h += b_delta[:, None] * b_k[None, :]
            b_o = tl.sum(b_h * (b_q * scale)[None, :], 1)
        else:
            b_delta = b_beta * (b_v - tl.sum(b_h * b_k[:, None], 0))
            b_h += b_k[:, None] * b_delta[None, :]
            b_o = tl.sum(b_h * (b_q * scale)[:, None], 0)
        tl.store(o + (t * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=mask_v)
    if STORE_FINAL_STATE:
        tl.store(ht + state_offset, b_h, mask=mask_h)


def fused_recurrent_gated_delta_rule_fwd(q, k, v, g, beta, scale, initial_state, output_final_state,
                                         cu_seqlens, use_qk_l2norm_in_kernel, gate=None, beta_scale: float = 0.0,
                                         state_v_first: bool = False):
    """Host function: flatten the batch, launch one program per (V block, sequence × value head). gate: (A_log,
    dt_bias or None) when g is the raw a; beta_scale: β = beta_scale·sigmoid(beta), or 0 for β = beta;
    state_v_first: initial and final states [N, HV, V, K]."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    offsets = sequence_offsets(B, T, cu_seqlens, q.device)
    N = offsets.numel() - 1
    BK = triton.next_power_of_2(K)
    # (BV, warps) per state layout. H200, B256 HV16 K=V=128, fp32 state, one token: [K, V] 32 × 2 140 µs (fla 184);
    # [V, K] 8 × 1 133 µs (fla 131; 4 × 1 144; the [K, V] tile on this layout 171).
    BV, num_warps = (8, 1) if state_v_first else (32, 2)
    BV = min(triton.next_power_of_2(V), BV)
    o = torch.empty(B, T, HV, V, dtype=v.dtype, device=v.device)
    state_shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
    ht = torch.empty(state_shape, dtype=torch.float32, device=q.device) if output_final_state else None
    h0 = initial_state.contiguous() if initial_state is not None else None
    A_log, dt_bias = gate or (None, None)
    grid = (N * HV * triton.cdiv(V, BV),)
    fused_recurrent_gated_delta_rule_fwd_kernel[grid](
        q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(),
        None if A_log is None else A_log.contiguous(), None if dt_bias is None else dt_bias.contiguous(),
        o, h0, ht, offsets, scale, float(beta_scale), H=H, HV=HV, K=K, V=V, BK=BK, BV=BV,
        USE_INITIAL_STATE=h0 is not None, STORE_FINAL_STATE=output_final_state,
        USE_QK_L2NORM=use_qk_l2norm_in_kernel, USE_GATE=A_log is not None, HAS_DT_BIAS=dt_bias is not None,
        BETA_SIGMOID=bool(beta_scale), STATE_V_FIRST=state_v_first, num_warps=num_warps,
    )
    return o, ht
