"""KDA's intra-chunk kernels: the chunk's decayed score matrices (forward) and their gradients (backward).

With a decay per key channel, a chunk's pair (i, j) scores through the channels' decays between them,

    Akk_ij = Σ_d k_id k_jd e^{G_id − G_jd}   (j < i),     Aqk_ij = Σ_d q_id k_jd e^{G_id − G_jd}   (j ≤ i),

G the chunk-local cumsum of g (≤ 0, decreasing). The factors e^{G_i} and e^{−G_j} alone overflow once a chunk
decays by more than e^88, so every product is split at a reference row r between i and j, e^{G_i − G_r} · e^{G_r −
G_j}, both ≤ 1: for the 16-row blocks below the diagonal r is the first row of i's block (a [64, K] × [K, 64] dot
per block row, columns restricted to earlier blocks); inside a diagonal 16 × 16 block each pair's exponent is formed
directly (16 steps, each a [64, K] product reduced over K: row i against row j = 16⌊i/16⌋ + c of its own block).
The backward's four decayed products take the same split: row-side (Σ_j M_ij k_j e^{G_i − G_j}, dq and the k of
Akk's rows) with r the first row of i's block, column-side (Σ_i M_ij x_i e^{G_i − G_j}, dk) with r the last row of
j's block.

Forward (`kda_intra_fwd`, one program per (chunk, value head)): Akk and Aqk, then T = (I + diag(β) Akk)⁻¹ by
common/wy.py's solve; stores T and Aqk. Backward (`kda_intra_bwd`): from dM_P = scale·dO δᵀ and dA (the gradient of
diag(β) Akk) written by chunk_bwd.py's kernel, adds the intra-chunk parts of dq, dk, dG and dβ (README.md); one
program per (chunk, value head, INTRA_BWD_BK key channels), since every term but dβ's is per channel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.chunking import ChunkLayout, chunk_program
from ..common.launch import tile
from ..common.precision import cast_for_store, mm, mma, operand_dtype, solve_precision
from ..common.tuning import DEFAULT_TUNING, Tuning
from ..common.wy import solve_unit_lower

# the backward's key channels per program: [BT, K] fp32 tiles of the whole key width spilled (3.9 KB a thread at
# K = 128, sm_90; kernels/benchmarks/compile_report.py)
INTRA_BWD_BK = 32


@triton.jit
def gate_row(b_G, r, BT: tl.constexpr):
    """Row r of the [BT, BK] tile b_G, as a [BK] vector."""
    return tl.sum(tl.where((tl.arange(0, BT) == r)[:, None], b_G, 0.0), 0)


@triton.jit
def chunk_rows(x, t0, rows, mask, i_head, NH: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, k0=0):
    """The [BT, BK] fp32 tile whose row i is channels k0 .. k0 + BK of token t0 + rows[i] of head i_head of
    x [tokens, NH, K] (0 off mask)."""
    o_k = k0 + tl.arange(0, BK)
    return tl.load(x + ((t0 + rows)[:, None] * NH + i_head) * K + o_k[None, :],
                   mask=mask[:, None] & (o_k < K)[None, :], other=0.0).to(tl.float32)


@triton.jit
def kda_intra_fwd_kernel(
    q, k, G, beta, Aqk, Ai, cu_seqlens, chunk_indices,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    DOT_PREC: tl.constexpr, SOLVE_PREC: tl.constexpr,
):
    i_hv = tl.program_id(1)
    i_h = i_hv // (HV // H)
    i_c, i_n, i_t, bos, eos, o_i, o_t, m_t = chunk_program(cu_seqlens, chunk_indices, BT)
    t0 = bos + i_t * BT
    n_valid = tl.minimum(eos - t0, BT)
    b_q = chunk_rows(q, t0, o_i, m_t, i_h, H, K, BK)
    b_k = chunk_rows(k, t0, o_i, m_t, i_h, H, K, BK)
    b_G = chunk_rows(G, t0, o_i, m_t, i_hv, HV, K, BK)
    b_beta = tl.load(beta + o_t * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
    blk = o_i // 16
    b_Aqk = tl.zeros([BT, BT], dtype=tl.float32)
    b_Akk = tl.zeros([BT, BT], dtype=tl.float32)
    for I in tl.static_range(1, BT // 16):  # rows of block I against the earlier blocks' columns, split at r = 16 I
        b_Gr = gate_row(b_G, I * 16, BT)
        m_row = ((blk == I) & m_t)[:, None]
        m_col = ((o_i < I * 16) & m_t & (I * 16 < n_valid))[:, None]
        b_col = tl.where(m_col, b_k * tl.exp(tl.where(m_col, b_Gr[None, :] - b_G, 0.0)), 0.0)
        b_rs = tl.where(m_row, tl.exp(tl.where(m_row, b_G - b_Gr[None, :], 0.0)), 0.0)
        b_Aqk = mma(b_q * b_rs, tl.trans(b_col), b_Aqk, DOT_PREC)
        b_Akk = mma(b_k * b_rs, tl.trans(b_col), b_Akk, DOT_PREC)
    for c in range(16):  # the diagonal blocks: row i against j = 16⌊i/16⌋ + c, each pair's exponent formed directly
        j = blk * 16 + c
        m_j = (j <= o_i) & m_t
        b_Gj = chunk_rows(G, t0, j, m_j, i_hv, HV, K, BK)
        b_E = chunk_rows(k, t0, j, m_j, i_h, H, K, BK) * tl.exp(tl.where(m_j[:, None], b_G - b_Gj, 0.0))
        sel = o_i[None, :] == j[:, None]
        b_Aqk += tl.where(sel, tl.sum(b_q * b_E, 1)[:, None], 0.0)
        b_Akk += tl.where(sel & (j < o_i)[:, None], tl.sum(b_k * b_E, 1)[:, None], 0.0)
    b_T = solve_unit_lower(b_Akk * b_beta[:, None], BT, SOLVE_PREC)
    p_A = (o_t[:, None] * HV + i_hv) * BT + o_i[None, :]
    tl.store(Ai + p_A, cast_for_store(b_T, Ai, DOT_PREC), mask=m_t[:, None])
    tl.store(Aqk + p_A, cast_for_store(b_Aqk, Aqk, DOT_PREC), mask=m_t[:, None])


@triton.jit
def kda_intra_bwd_kernel(
    q, k, G, beta, dMP, dA, dq, dk, dG, dbeta_part, cu_seqlens, chunk_indices,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    # one program per (chunk, value head, BK channels): every term is per channel but dβ's, a partial sum here
    i_hv, i_kb = tl.program_id(1), tl.program_id(2)
    i_h = i_hv // (HV // H)
    k0 = i_kb * BK
    i_c, i_n, i_t, bos, eos, o_i, o_t, m_t = chunk_program(cu_seqlens, chunk_indices, BT)
    t0 = bos + i_t * BT
    n_valid = tl.minimum(eos - t0, BT)
    b_q = chunk_rows(q, t0, o_i, m_t, i_h, H, K, BK, k0)
    b_k = chunk_rows(k, t0, o_i, m_t, i_h, H, K, BK, k0)
    b_G = chunk_rows(G, t0, o_i, m_t, i_hv, HV, K, BK, k0)
    b_beta = tl.load(beta + o_t * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
    blk = o_i // 16
    m_A = m_t[:, None] & m_t[None, :]
    p_M = (o_t[:, None] * HV + i_hv) * BT + o_i[None, :]
    b_dMP = tl.load(dMP + p_M, mask=m_A, other=0.0)
    b_dA = tl.load(dA + p_M, mask=m_A, other=0.0)
    # Row side: dq_P = Σ_j dM_P,ij k_j e^{G_i − G_j};  R = Σ_j dA_ij k_j e^{G_i − G_j}
    b_dqP = tl.zeros([BT, BK], dtype=tl.float32)
    b_R = tl.zeros([BT, BK], dtype=tl.float32)
    for I in tl.static_range(1, BT // 16):
        b_Gr = gate_row(b_G, I * 16, BT)
        m_row = ((blk == I) & m_t)[:, None]
        m_col = ((o_i < I * 16) & m_t & (I * 16 < n_valid))[:, None]
        b_col = tl.where(m_col, b_k * tl.exp(tl.where(m_col, b_Gr[None, :] - b_G, 0.0)), 0.0)
        b_rs = tl.where(m_row, tl.exp(tl.where(m_row, b_G - b_Gr[None, :], 0.0)), 0.0)
        b_dqP += b_rs * mm(b_dMP, b_col, DOT_PREC)
        b_R += b_rs * mm(b_dA, b_col, DOT_PREC)
    for c in range(16):
        j = blk * 16 + c
        m_j = (j <= o_i) & m_t
        b_Gj = chunk_rows(G, t0, j, m_j, i_hv, HV, K, BK, k0)
        b_E = chunk_rows(k, t0, j, m_j, i_h, H, K, BK, k0) * tl.exp(tl.where(m_j[:, None], b_G - b_Gj, 0.0))
        sel = o_i[None, :] == j[:, None]
        b_dqP += tl.sum(tl.where(sel, b_dMP, 0.0), 1)[:, None] * b_E
        b_R += tl.sum(tl.where(sel, b_dA, 0.0), 1)[:, None] * b_E
    # Column side: dk_P = Σ_i dM_P,ij q_i e^{G_i − G_j};  C = Σ_i β_i dA_ij k_i e^{G_i − G_j}. Mᵀ [j, i] is read
    # from memory with transposed addresses, after the row side is done with M
    p_Mt = (o_t[None, :] * HV + i_hv) * BT + o_i[:, None]
    b_dMPt = tl.load(dMP + p_Mt, mask=m_A, other=0.0)
    b_dAt = tl.load(dA + p_Mt, mask=m_A, other=0.0) * b_beta[None, :]  # ∂L/∂Akk_ij = β_i dA_ij, transposed
    b_dkP = tl.zeros([BT, BK], dtype=tl.float32)
    b_C = tl.zeros([BT, BK], dtype=tl.float32)
    for J in tl.static_range(0, BT // 16 - 1):  # columns of block J against the later blocks' rows
        b_Gr = gate_row(b_G, tl.minimum(J * 16 + 15, n_valid - 1), BT)
        m_col = ((blk == J) & m_t)[:, None]
        m_row = ((o_i > J * 16 + 15) & m_t)[:, None]
        b_cs = tl.where(m_col, tl.exp(tl.where(m_col, b_Gr[None, :] - b_G, 0.0)), 0.0)
        b_e = tl.where(m_row, tl.exp(tl.where(m_row, b_G - b_Gr[None, :], 0.0)), 0.0)
        b_dkP += b_cs * mm(b_dMPt, b_q * b_e, DOT_PREC)
        b_C += b_cs * mm(b_dAt, b_k * b_e, DOT_PREC)
    for c in range(16):
        i = blk * 16 + c
        m_i = (i >= o_i) & (i < n_valid) & m_t
        b_E = tl.exp(tl.where(m_i[:, None], chunk_rows(G, t0, i, m_i, i_hv, HV, K, BK, k0) - b_G, 0.0))
        sel = o_i[None, :] == i[:, None]
        b_dkP += tl.sum(tl.where(sel, b_dMPt, 0.0), 1)[:, None] * chunk_rows(q, t0, i, m_i, i_h, H, K, BK, k0) * b_E
        b_C += tl.sum(tl.where(sel, b_dAt, 0.0), 1)[:, None] * chunk_rows(k, t0, i, m_i, i_h, H, K, BK, k0) * b_E
    # Add to the state-side parts chunk_bwd.py's kernel wrote (fp32, per value head)
    o_k = k0 + tl.arange(0, BK)
    m_tk = m_t[:, None] & (o_k < K)[None, :]
    p_k = (o_t[:, None] * HV + i_hv) * K + o_k[None, :]
    b_bR = b_R * b_beta[:, None]
    tl.store(dq + p_k, tl.load(dq + p_k, mask=m_tk, other=0.0) + b_dqP, mask=m_tk)
    tl.store(dk + p_k, tl.load(dk + p_k, mask=m_tk, other=0.0) + b_dkP + b_bR + b_C, mask=m_tk)
    b_dG = b_q * b_dqP - b_k * b_dkP + b_k * (b_bR - b_C)
    tl.store(dG + p_k, tl.load(dG + p_k, mask=m_tk, other=0.0) + b_dG, mask=m_tk)
    tl.store(dbeta_part + (o_t * HV + i_hv) * tl.num_programs(2) + i_kb, tl.sum(b_k * b_R, 1), mask=m_t)


def kda_intra_fwd(q, k, G, beta, layout: ChunkLayout, *, aqk_dtype: torch.dtype, dot_prec: str,
                  tuning: Tuning = DEFAULT_TUNING):
    """q, k [tokens, H, K], G [tokens, HV, K] fp32, beta [tokens, HV] → (Ai [tokens, HV, BT]: T in
    operand_dtype(k.dtype, dot_prec), Aqk [tokens, HV, BT] in aqk_dtype, zero above the diagonal). dot_prec: the
    recurrence's DOT_PREC (T feeds the state passes)."""
    TT, H, K = k.shape
    HV = beta.shape[1]
    BT = layout.chunk_size
    Ai = torch.empty(TT, HV, BT, dtype=operand_dtype(k.dtype, dot_prec), device=k.device)
    Aqk = torch.empty(TT, HV, BT, dtype=aqk_dtype, device=k.device)
    if layout.num_chunks:
        kda_intra_fwd_kernel[(layout.num_chunks, HV)](
            q, k, G, beta, Aqk, Ai, layout.cu_seqlens, layout.chunk_indices, H=H, HV=HV, K=K, BT=BT, BK=tile(K),
            DOT_PREC=tuning.dot(kda_intra_fwd_kernel, dot_prec), SOLVE_PREC=solve_precision(k.dtype),
            **tuning.launch("kda_intra_fwd"))
    return Ai, Aqk


def kda_intra_bwd(q, k, G, beta, dMP, dA, dq, dk, dG, dbeta, layout: ChunkLayout, *, dot_prec: str,
                  tuning: Tuning = DEFAULT_TUNING) -> None:
    """Adds the intra-chunk gradients into dq, dk [tokens, HV, K], dG [tokens, HV, K] and dbeta [tokens, HV] (all
    fp32, in place) from dMP = scale·dO δᵀ and dA [tokens, HV, BT] (fp32, masked to the chunk's triangles). The key
    channels split over programs of INTRA_BWD_BK each; dβ sums their partial sums."""
    TT, H, K = k.shape
    HV = beta.shape[1]
    if layout.num_chunks:
        BK = tile(K, INTRA_BWD_BK)
        NK = triton.cdiv(K, BK)
        dbeta_part = torch.empty(TT, HV, NK, dtype=torch.float32, device=k.device)
        kda_intra_bwd_kernel[(layout.num_chunks, HV, NK)](
            q, k, G, beta, dMP, dA, dq, dk, dG, dbeta_part, layout.cu_seqlens, layout.chunk_indices, H=H, HV=HV,
            K=K, BT=layout.chunk_size, BK=BK, DOT_PREC=tuning.dot(kda_intra_bwd_kernel, dot_prec),
            **tuning.launch("kda_intra_bwd"))
        dbeta += dbeta_part.sum(-1)
