"""Chunked gated delta product, forward: the log gate at each token's first sub-step → chunk-local gate cumsum → WY
→ state pass (ops/common, on the expanded T·n_h sub-step axis, k, v, beta as given) → the output pass below,
strided: queries only at each token's last sub-step.

The chunk machinery runs on the expanded axis of T·n_h sub-steps (chunks of 64 sub-steps). Instead of a [64, K]
query tile that is zero in all but every n_h-th row, each program loads only the BQ ≥ ⌈64 / n_h⌉ query rows that
fall in its chunk (row t·n_h + n_h − 1 holds token t's query), straight from q [tokens, H, K], and writes o
[tokens, HV, V] directly. With c_i the chunk-local sub-step of query i, S the chunk-start state, δ the corrected
values and G the chunk-local gate cumsum (expanded axis):

    o_i = scale · (exp(G_{c_i}) q_iᵀ S + Σ_{j ≤ c_i} exp(G_{c_i} − G_j) (q_iᵀ k_j) δ_j)

which is the gated delta rule's output pass restricted to the query rows: n_h× fewer rows in Q S, Q Kᵀ and A δ, and
no zero-query tensor or expanded output to allocate and gather.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.chunking import ChunkLayout, chunk_program
from ..common.cumsum import chunk_local_cumsum
from ..common.precision import cast_for_store, mma, raw_precision
from ..common.state_pass import chunk_states_fwd
from ..common.tuning import DEFAULT_TUNING, Tuning


@triton.jit
def strided_output_fwd_kernel(
    q, k, v_new, h, G, o, cu_seqlens, chunk_indices, chunk_offsets, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, NH: tl.constexpr, BT: tl.constexpr,
    BQ: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DOT_PREC: tl.constexpr, RAW_PREC: tl.constexpr,
):
    i_v, i_hv = tl.program_id(1), tl.program_id(2)
    i_h = i_hv // (HV // H)
    # bos, eos: sub-step offsets (cu_seqlens · n_h); o_s: the chunk's sub-step rows
    i_c, i_n, i_t, bos, eos, o_i, o_s, m_s = chunk_program(cu_seqlens, chunk_indices, BT)
    i_hc = tl.load(chunk_offsets + i_n).to(tl.int64) + i_t
    s0 = i_t * BT                                     # the chunk's first sub-step within the sequence
    # Query slots: chunk-local sub-step c = first + NH·slot, the last sub-step of token (s0 + c) // NH.
    first = (NH - 1 - s0 % NH) % NH
    o_c = first + NH * tl.arange(0, BQ)
    m_q = (o_c < BT) & (bos + s0 + o_c < eos)
    o_tok = bos // NH + (s0 + o_c) // NH              # token rows of q and o
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    b_o = tl.zeros([BQ, BV], dtype=tl.float32)
    b_A = tl.zeros([BQ, BT], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        # loaded as stored: they feed only dots (common/precision.py mm)
        b_q = tl.load(q + (o_tok[:, None] * H + i_h) * K + o_k[None, :], mask=m_q[:, None] & m_k[None, :],
                      other=0.0)
        b_k = tl.load(k + (o_s[:, None] * H + i_h) * K + o_k[None, :], mask=m_s[:, None] & m_k[None, :], other=0.0)
        b_h = tl.load(h + (i_hc * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :],
                      mask=m_k[:, None] & m_v[None, :], other=0.0)
        b_o = mma(b_q, b_h, b_o, DOT_PREC)
        b_A = mma(b_q, tl.trans(b_k), b_A, RAW_PREC)
    m_A = (o_c[:, None] >= o_i[None, :]) & m_q[:, None] & m_s[None, :]
    b_Gq = tl.load(G + (bos + s0 + o_c) * HV + i_hv, mask=m_q, other=0.0)
    b_Gs = tl.load(G + o_s * HV + i_hv, mask=m_s, other=0.0)
    b_o = b_o * tl.exp(b_Gq)[:, None]
    b_A = tl.where(m_A, b_A * tl.exp(tl.where(m_A, b_Gq[:, None] - b_Gs[None, :], 0.0)), 0.0)
    b_v = tl.load(v_new + (o_s[:, None] * HV + i_hv) * V + o_v[None, :], mask=m_s[:, None] & m_v[None, :],
                  other=0.0)
    b_o = mma(b_A, b_v, b_o, DOT_PREC) * scale
    tl.store(o + (o_tok[:, None] * HV + i_hv) * V + o_v[None, :], cast_for_store(b_o, o, DOT_PREC),
             mask=m_q[:, None] & m_v[None, :])


def strided_output_fwd(q, k, v_new, h, G, scale: float, num_householder: int, layout: ChunkLayout,
                       out_dtype, *, dot_prec: str, tuning: Tuning = DEFAULT_TUNING) -> torch.Tensor:
    """q [tokens, H, K]; k [tokens·n_h, H, K]; v_new [tokens·n_h, HV, V] fp32; h [chunks, HV, K, V] fp32 chunk-start
    states; G [tokens·n_h, HV] fp32; layout over the sub-step axis → o [tokens, HV, V] in out_dtype, its dots in
    dot_prec (the op's `dot`); tuning: only its `dots` applies (the launch keeps Triton's defaults)."""
    TQ, H, K = q.shape
    HV, V = v_new.shape[1], v_new.shape[2]
    o = torch.empty(TQ, HV, V, dtype=out_dtype, device=q.device)
    BT = layout.chunk_size
    BQ = max(16, triton.next_power_of_2(triton.cdiv(BT, num_householder)))  # ≥ 16: tl.dot's minimum tile
    BK, BV = min(64, triton.next_power_of_2(K)), min(64, triton.next_power_of_2(V))
    if layout.num_chunks:
        strided_output_fwd_kernel[(layout.num_chunks, triton.cdiv(V, BV), HV)](
            q, k, v_new, h, G, o, layout.cu_seqlens, layout.chunk_indices, layout.chunk_offsets, scale,
            H=H, HV=HV, K=K, V=V, NH=num_householder, BT=BT, BQ=BQ, BK=BK, BV=BV,
            DOT_PREC=tuning.dot(strided_output_fwd_kernel, dot_prec), RAW_PREC=raw_precision(q.dtype))
    return o


def to_first_substep(x: torch.Tensor, num_householder: int) -> torch.Tensor:
    """[B, T, ...] → [B, T·n_h, ...] with x_t at row t·n_h and zeros elsewhere."""
    B, T = x.shape[:2]
    zeros = x.new_zeros(B, T, num_householder - 1, *x.shape[2:])
    return torch.cat([x[:, :, None], zeros], dim=2).reshape(B, T * num_householder, *x.shape[2:])


def chunk_gated_delta_product_fwd(q, k, v, g_sub, beta, scale: float, num_householder: int, initial_state,
                                  output_final_state: bool, layout: ChunkLayout, out_dtype, *, dot_prec: str,
                                  recurrence_prec: str, tuning: Tuning = DEFAULT_TUNING):
    """Flattened contiguous inputs q [tokens, H, K], k [tokens·n_h, H, K], v [tokens·n_h, HV, V], g_sub, beta
    [tokens·n_h, HV] (g_sub: the log gate at each token's first sub-step, to_first_substep) and a layout over the
    sub-step axis → (o [tokens, HV, V] in out_dtype, final state or None, G fp32 chunk-local gate cumsum, Ai: the T
    matrices). recurrence_prec: the WY and state-pass kernels' DOT_PREC; dot_prec: the output pass's; tuning: the
    launch choices (common/tuning.py)."""
    G = chunk_local_cumsum(g_sub, layout)
    Ai, h, v_new, ht = chunk_states_fwd(k, v, beta, G, initial_state, output_final_state, layout,
                                        dot_prec=recurrence_prec, tuning=tuning)
    o = strided_output_fwd(q, k, v_new, h, G, scale, num_householder, layout, out_dtype, dot_prec=dot_prec,
                           tuning=tuning)
    return o, ht, G, Ai
