"""Backward of the WY / UT representation (common/wy.py): from dw, du to dk, dv, dβ and the chunk-local gate
cumsum gradient dG, using the stored T = (I + A)⁻¹.

With K̃ = diag(βγ) K, Ṽ = diag(β) V, w = T K̃, u = T Ṽ:
    dK̃ = Tᵀ dw,  dṼ = Tᵀ du,  dT = dw K̃ᵀ + du Ṽᵀ,  dA = −Tᵀ dT Tᵀ restricted to the strict lower triangle,
and with A_ij = β_i exp(G_i − G_j) k_iᵀk_j:
    dk += βγ ⊙ dK̃ + (dA ⊙ β_i e^{G_i−G_j}) K + (dA ⊙ β_i e^{G_i−G_j})ᵀ K,   dv = β ⊙ dṼ
    dβ_i = Σ dK̃_i ⊙ γ_i k_i + Σ dṼ_i ⊙ v_i + Σ_j dA_ij e^{G_i−G_j} k_iᵀk_j
    dG_i += β_iγ_i Σ dK̃_i ⊙ k_i + Σ_j (dA ⊙ A)_ij − Σ_j (dA ⊙ A)_ji
One program per (chunk, value head); two sweeps over K/V blocks (the first accumulates dT, the second writes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .chunking import ChunkLayout, chunk_program
from .launch import tile
from .precision import cast_for_store, mm, mma, operand_dtype, raw_precision
from .scratch import scratch_tiles, transpose_via_scratch
from .tuning import DEFAULT_TUNING, Tuning


@triton.jit
def gated_wy_bwd_kernel(
    k, v, beta, G, Ai, dw, du, dk, dk_out, dv, dbeta, dG, scratch, cu_seqlens, chunk_indices,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr, DOT_PREC: tl.constexpr, RAW_PREC: tl.constexpr,
):
    i_hv = tl.program_id(1)
    i_h = i_hv // (HV // H)
    i_c, i_n, i_t, bos, eos, o_i, o_t, m_t = chunk_program(cu_seqlens, chunk_indices, BT)
    b_beta = tl.load(beta + o_t * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
    if USE_G:
        b_G = tl.load(G + o_t * HV + i_hv, mask=m_t, other=0.0)
    else:
        b_G = tl.zeros([BT], dtype=tl.float32)
    b_gamma = tl.exp(b_G)
    b_T = tl.load(Ai + (o_t[:, None] * HV + i_hv) * BT + o_i[None, :], mask=m_t[:, None], other=0.0)
    # dT = (dw Kᵀ diag(γ) + du Vᵀ) diag(β): the gates scale dT's columns (dTᵀ's rows) after the dots, so k, dw, v
    # and du reach the dots as stored (common/precision.py mm) and k is not rounded after scaling
    b_dT = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = m_t[:, None] & (o_k < K)[None, :]
        b_k = tl.load(k + (o_t[:, None] * H + i_h) * K + o_k[None, :], mask=m_k, other=0.0)
        b_dw = tl.load(dw + (o_t[:, None] * HV + i_hv) * K + o_k[None, :], mask=m_k, other=0.0)
        b_dT = mma(b_dw, tl.trans(b_k), b_dT, DOT_PREC)
    b_dT = b_dT * b_gamma[None, :]
    b_dbeta = tl.zeros([BT], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = m_t[:, None] & (o_v < V)[None, :]
        p_v = (o_t[:, None] * HV + i_hv) * V + o_v[None, :]
        b_v = tl.load(v + p_v, mask=m_v, other=0.0)
        b_du = tl.load(du + p_v, mask=m_v, other=0.0)
        b_dT = mma(b_du, tl.trans(b_v), b_dT, DOT_PREC)
        b_dvt = mm(tl.trans(b_T), b_du, DOT_PREC)
        b_dbeta += tl.sum(b_dvt * b_v.to(tl.float32), 1)
        tl.store(dv + p_v, cast_for_store(b_dvt * b_beta[:, None], dv, DOT_PREC), mask=m_v)
    b_dT = b_dT * b_beta[None, :]
    # dA = −Tᵀ dT Tᵀ on the strict lower triangle.
    m_A = (o_i[:, None] > o_i[None, :]) & m_t[:, None] & m_t[None, :]
    b_dA = mm(mm(tl.trans(b_T), b_dT, DOT_PREC), tl.trans(b_T), DOT_PREC)
    b_E = tl.where(m_A, tl.exp(tl.where(m_A, b_G[:, None] - b_G[None, :], 0.0)), 0.0)
    b_dA = tl.where(m_A, -b_dA, 0.0)
    b_dAE = b_dA * b_E  # ∂L/∂(β_i k_iᵀk_j) without β
    b_B = b_dAE * b_beta[:, None]
    b_dG = tl.zeros([BT], dtype=tl.float32)
    # B (strictly lower) and Bᵀ (strictly upper) never overlap: their sum is exact, and one dot per K block takes it.
    # Bᵀ is not tl.trans(b_B): transposing a tensor-core dot result is miscompiled on Hopper by Triton 3.4–3.7.0
    # (fla #640: wrong dk), so it makes a round trip through a scratch tile (common/scratch.py).
    b_BBt = b_B + transpose_via_scratch(b_B, scratch, i_c, i_hv, HV, BT, DOT_PREC)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = m_t[:, None] & (o_k < K)[None, :]
        b_k = tl.load(k + (o_t[:, None] * H + i_h) * K + o_k[None, :], mask=m_k, other=0.0).to(tl.float32)
        p_k = (o_t[:, None] * HV + i_hv) * K + o_k[None, :]
        b_dw = tl.load(dw + p_k, mask=m_k, other=0.0).to(tl.float32)
        # dA ⊙ A's terms of dβ and dG, summed per K block (k kᵀ = Σ over K blocks is never held whole)
        b_dAA = b_dAE * mm(b_k, tl.trans(b_k), RAW_PREC)
        b_dbeta += tl.sum(b_dAA, 1)
        b_dAA *= b_beta[:, None]
        b_dG += tl.sum(b_dAA, 1) - tl.sum(b_dAA, 0)
        b_dkt = mm(tl.trans(b_T), b_dw, DOT_PREC)
        b_dkt_k = tl.sum(b_dkt * b_k, 1)
        b_dbeta += b_dkt_k * b_gamma
        b_dG += b_dkt_k * b_gamma * b_beta
        b_dk = tl.load(dk + p_k, mask=m_k, other=0.0)
        b_dk += b_dkt * (b_beta * b_gamma)[:, None]
        b_dk += mm(b_BBt, b_k, DOT_PREC)
        tl.store(dk_out + p_k, cast_for_store(b_dk, dk_out, DOT_PREC), mask=m_k)
    tl.store(dbeta + o_t * HV + i_hv, cast_for_store(b_dbeta, dbeta, DOT_PREC), mask=m_t)
    if USE_G:
        b_dG += tl.load(dG + o_t * HV + i_hv, mask=m_t, other=0.0)
        tl.store(dG + o_t * HV + i_hv, b_dG, mask=m_t)


def gated_wy_bwd(k, v, beta, G, Ai, dw, du, dk, dG, layout: ChunkLayout, dk_final: bool = False, *, dot_prec: str,
                 tuning: Tuning = DEFAULT_TUNING):
    """Adds the WY backward into dk [tokens, HV, K] fp32 and dG [tokens, HV] fp32; returns (dk, dv [tokens, HV, V]
    in v's dtype, dbeta [tokens, HV] in beta's): final gradients written once, no cast kernels after. With dk_final
    dk comes back in k's dtype (a new tensor); else the fp32 dk, summed further by the caller (GVA). dot_prec: the
    recurrence's DOT_PREC, the forward's (precision.recurrence_dot_precision); tuning: the launch choices."""
    TT, H, K = k.shape
    HV, V = v.shape[1], v.shape[2]
    dv = torch.empty(TT, HV, V, dtype=v.dtype, device=k.device)
    dbeta = torch.empty(TT, HV, dtype=beta.dtype, device=k.device)
    dk_out = torch.empty_like(dk, dtype=k.dtype) if dk_final and k.dtype != dk.dtype else dk
    if layout.num_chunks:
        scratch = scratch_tiles(layout, HV, operand_dtype(k.dtype, dot_prec), k.device)
        gated_wy_bwd_kernel[(layout.num_chunks, HV)](
            k, v, beta, G, Ai, dw, du, dk, dk_out, dv, dbeta, dG, scratch, layout.cu_seqlens, layout.chunk_indices,
            H=H, HV=HV, K=K, V=V, BT=layout.chunk_size, BK=tile(K, 64), BV=tile(V, 64), USE_G=G is not None,
            DOT_PREC=tuning.dot(gated_wy_bwd_kernel, dot_prec), RAW_PREC=raw_precision(k.dtype),
            **tuning.launch("wy_bwd"))
    return dk_out, dv, dbeta
