"""Fused-recurrent gated delta product, forward: one Triton program per (sequence, value head, V block) walks the
tokens, applying each token's gate and its n_h Householder sub-steps to the fp32 state tile in registers, and writes
the token's output once. Built for decoding (T = 1 with the cache state in and out) and short sequences;
function.py's autograd Function runs its backward through the chunked path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.chunking import sequence_offsets


@triton.jit
def fused_recurrent_gated_delta_product_fwd_kernel(
    q, k, v, g, beta, o, h0, ht, cu_seqlens, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, NH: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr, USE_INITIAL_STATE: tl.constexpr,
    STORE_FINAL_STATE: tl.constexpr, USE_QK_L2NORM: tl.constexpr,
):
    i_nh, i_v = tl.program_id(0), tl.program_id(1)  # sequences × heads on axis 0 (no 65535 limit)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)  # token offsets of q; sub-step rows are t·NH + j
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k, mask_v = o_k < K, o_v < V
    mask_h = mask_k[:, None] & mask_v[None, :]
    state_offset = (i_n * HV + i_hv).to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]

    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_INITIAL_STATE:
        b_h += tl.load(h0 + state_offset, mask=mask_h, other=0.0).to(tl.float32)
    for t in range(bos, eos):
        if USE_G:
            b_h *= tl.exp(tl.load(g + t * HV + i_hv).to(tl.float32))
        for j in tl.static_range(NH):
            r = t * NH + j
            b_k = tl.load(k + (r * H + i_h) * K + o_k, mask=mask_k, other=0.0).to(tl.float32)
            b_v = tl.load(v + (r * HV + i_hv) * V + o_v, mask=mask_v, other=0.0).to(tl.float32)
            b_beta = tl.load(beta + r * HV + i_hv).to(tl.float32)
            if USE_QK_L2NORM:
                b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
            # delta = β (v − Sᵀ k): what the state is missing for key k.
            b_delta = b_beta * (b_v - tl.sum(b_h * b_k[:, None], 0))
            b_h += b_k[:, None] * b_delta[None, :]
        b_q = tl.load(q + (t * H + i_h) * K + o_k, mask=mask_k, other=0.0).to(tl.float32)
        if USE_QK_L2NORM:
            b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6)
        b_o = tl.sum(b_h * (b_q * scale)[:, None], 0)
        tl.store(o + (t * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=mask_v)
    if STORE_FINAL_STATE:
        tl.store(ht + state_offset, b_h, mask=mask_h)


def fused_recurrent_gated_delta_product_fwd(q, k, v, g, beta, num_householder, scale, initial_state,
                                            output_final_state, cu_seqlens, use_qk_l2norm_in_kernel):
    """Host function: flatten the batch, launch one program per (sequence × value head, V block)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    offsets = sequence_offsets(B, T, cu_seqlens, q.device)
    N = offsets.numel() - 1
    BK = triton.next_power_of_2(K)
    # BV=32, 2 warps: the gated delta rule's fused-recurrent choice (a [128, 32] fp32 tile, 16 registers/thread);
    # the sub-step loop adds no live tiles. Untuned on the device.
    BV = min(triton.next_power_of_2(V), 32)
    o = torch.empty(B, T, HV, V, dtype=v.dtype, device=v.device)
    ht = torch.empty(N, HV, K, V, dtype=torch.float32, device=q.device) if output_final_state else None
    h0 = initial_state.contiguous() if initial_state is not None else None
    grid = (N * HV, triton.cdiv(V, BV))
    fused_recurrent_gated_delta_product_fwd_kernel[grid](
        q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous() if g is not None else None,
        beta.contiguous(), o, h0, ht, offsets, scale, H=H, HV=HV, K=K, V=V, NH=num_householder, BK=BK, BV=BV,
        USE_G=g is not None, USE_INITIAL_STATE=h0 is not None, STORE_FINAL_STATE=output_final_state,
        USE_QK_L2NORM=use_qk_l2norm_in_kernel, num_warps=2,
    )
    return o, ht
