"""Fused-recurrent IPLR delta rule, forward: one Triton program per (sequence, head, V block) walks the tokens with
the fp32 state tile in registers. Built for decoding (T = 1 with the cache state in and out) and short sequences;
function.py's autograd Function runs its backward through the chunked backward kernels.

Each state column evolves on its own (a_tᵀ S reads column by column), so V blocks are independent programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.chunking import sequence_offsets


@triton.jit
def fused_recurrent_iplr_fwd_kernel(
    q, k, v, a, b, o, h0, ht, cu_seqlens, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr,
):
    i_nh, i_v = tl.program_id(0), tl.program_id(1)  # sequences × heads on axis 0 (no 65535 limit)
    i_n, i_h = i_nh // H, i_nh % H
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k, mask_v = o_k < K, o_v < V
    mask_h = mask_k[:, None] & mask_v[None, :]
    state_offset = (i_n * H + i_h).to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]

    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_INITIAL_STATE:
        b_h += tl.load(h0 + state_offset, mask=mask_h, other=0.0).to(tl.float32)
    for t in range(bos, eos):
        p_k = (t * H + i_h) * K + o_k
        b_q = tl.load(q + p_k, mask=mask_k, other=0.0).to(tl.float32)
        b_k = tl.load(k + p_k, mask=mask_k, other=0.0).to(tl.float32)
        b_a = tl.load(a + p_k, mask=mask_k, other=0.0).to(tl.float32)
        b_b = tl.load(b + p_k, mask=mask_k, other=0.0).to(tl.float32)
        b_v = tl.load(v + (t * H + i_h) * V + o_v, mask=mask_v, other=0.0).to(tl.float32)
        b_read = tl.sum(b_h * b_a[:, None], 0)  # a_tᵀ S_{t−1}
        b_h += b_b[:, None] * b_read[None, :] + b_k[:, None] * b_v[None, :]
        b_o = tl.sum(b_h * (b_q * scale)[:, None], 0)
        tl.store(o + (t * H + i_h) * V + o_v, b_o.to(o.dtype.element_ty), mask=mask_v)
    if STORE_FINAL_STATE:
        tl.store(ht + state_offset, b_h, mask=mask_h)


def fused_recurrent_iplr_delta_rule_fwd(q, k, v, a, b, scale, initial_state, output_final_state, cu_seqlens):
    """Host function: flatten the batch, launch one program per (V block, sequence × head)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    offsets = sequence_offsets(B, T, cu_seqlens, q.device)
    N = offsets.numel() - 1
    BK = triton.next_power_of_2(K)
    # BV=32 as in the gated delta rule's decode kernel: a [128, 32] fp32 tile is 16 registers/thread at 2 warps.
    BV = min(triton.next_power_of_2(V), 32)
    o = torch.empty(B, T, H, V, dtype=v.dtype, device=v.device)
    ht = torch.empty(N, H, K, V, dtype=torch.float32, device=q.device) if output_final_state else None
    h0 = initial_state.contiguous() if initial_state is not None else None
    if N * H > 0:
        fused_recurrent_iplr_fwd_kernel[(N * H, triton.cdiv(V, BV))](
            q.contiguous(), k.contiguous(), v.contiguous(), a.contiguous(), b.contiguous(), o, h0, ht, offsets,
            scale, H=H, K=K, V=V, BK=BK, BV=BV, USE_INITIAL_STATE=h0 is not None,
            STORE_FINAL_STATE=output_final_state, num_warps=2)
    return o, ht
