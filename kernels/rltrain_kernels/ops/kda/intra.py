"""KDA's intra-chunk kernels: the chunk's decayed score matrices (forward) and their gradients (backward).

With a decay per key channel, a chunk's pair (i, j) scores through the channels' decays between them,

    Akk_ij = Σ_d k_id k_jd e^{G_id − G_jd}   (j < i),     Aqk_ij = Σ_d q_id k_jd e^{G_id − G_jd}   (j ≤ i),

G the chunk-local cumsum of g (≤ 0, decreasing). The factors e^{G_i} and e^{−G_j} alone overflow once a chunk
decays by more than e^88, so every product is split at a reference row r between i and j, e^{G_i − G_r} · e^{G_r −
G_j}, both ≤ 1: for the 16-row blocks below the diagonal r is the first row of i's block (a [16, BK] × [BK, BT] dot
per INTRA_BK channels, columns restricted to earlier blocks). A diagonal 16 × 16 block whose decay over its rows stays
within DIAG_SPAN takes the same split at its first row as one dot at the solve's precision (one factor then ≥ 1, at
most e^SPAN); a block that decays more has each pair's exponent formed directly (16 steps, its [16, K] rows against
one token c of the block, a vector). The backward's four decayed products take the same split: row-side (Σ_j M_ij
k_j e^{G_i − G_j}, dq and the k of Akk's rows) with r the first row of i's block, column-side (Σ_i M_ij x_i e^{G_i −
G_j}, dk) with r the last row of j's block; its diagonal blocks go through four dots at the solve's precision within
DIAG_SPAN, else steps that serve both sides with one exponent. The solve's precision (≈ fp32) keeps dG's
cancellations: its pair terms q_i·dM_ij·k_j e^{G_i − G_j} enter dq's and dk's sides alike and cancel in dG, which
bf16 dots would leave as noise (3× dG's error, measured).

Forward: `kda_intra_fwd_kernel`, one program per (chunk, value head, 16-row block): the block's rows of Aqk (stored)
and Akk (to an fp32 scratch), and its diagonal block of T = (I + diag(β) Akk)⁻¹ by forward substitution; then
`kda_solve_kernel`, one program per (chunk, value head), merges the blocks into T with four dots. Backward
(`kda_intra_bwd`): from dM_P = scale·dO δᵀ and dA (the gradient of diag(β) Akk) written by chunk_bwd.py's kernels,
adds the intra-chunk parts of dq, dk, dG and dβ (README.md); one program per (chunk, value head, INTRA_BK key
channels, 16-row block), since every term but dβ's is per channel. A block's rows take its own block, the columns
before it and the rows after it; small programs (2 warps) keep the SMs full where one program walking a chunk's
blocks ran at 2 per SM.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.chunking import ChunkLayout, chunk_program
from ..common.launch import tile
from ..common.precision import cast_for_store, mm, mma, operand_dtype, solve_precision
from ..common.tuning import DEFAULT_TUNING, Tuning
from ..common.wy import merge_block_inverses

# a diagonal block's decay over its 16 rows (the largest over the channels) up to which its pairs go through one
# dot at the solve's precision: the operands stay within e^±40 of q and k, far inside fp32's range
DIAG_SPAN = 40.0

# key channels a step: the forward's off-diagonal dots and the backward's programs take this many at a time (the
# whole key width in [64, K] fp32 tiles spilled at K = 128 on sm_90; kernels/benchmarks/compile_report.py)
INTRA_BK = 32


@triton.jit
def chunk_rows(x, t0, rows, mask, i_head, NH: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, k0=0):
    """The [len(rows), BK] fp32 tile whose row i is channels k0 .. k0 + BK of token t0 + rows[i] of head i_head of
    x [tokens, NH, K] (0 off mask)."""
    o_k = k0 + tl.arange(0, BK)
    return tl.load(x + ((t0 + rows)[:, None] * NH + i_head) * K + o_k[None, :],
                   mask=mask[:, None] & (o_k < K)[None, :], other=0.0).to(tl.float32)


@triton.jit
def token_row(x, t0, row, n_rows, i_head, NH: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, k0=0):
    """Channels k0 .. k0 + BK of token t0 + row of head i_head of x [tokens, NH, K] as a [BK] fp32 vector (0 unless
    row < n_rows; the row test is made a vector: the interpreter cannot broadcast a scalar mask)."""
    o_k = k0 + tl.arange(0, BK)
    return tl.load(x + ((t0 + row) * NH + i_head) * K + o_k, mask=(o_k * 0 + row < n_rows) & (o_k < K),
                   other=0.0).to(tl.float32)


@triton.jit
def kda_intra_fwd_kernel(
    q, k, G, beta, Aqk, Akk, cu_seqlens, chunk_indices,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, KT: tl.constexpr, BK: tl.constexpr,
    DOT_PREC: tl.constexpr, SOLVE_PREC: tl.constexpr, DIAG_SPAN: tl.constexpr,
):
    # one program per (chunk, value head, 16-row block I)
    i_hv, I = tl.program_id(1), tl.program_id(2)
    i_h = i_hv // (HV // H)
    i_c, i_n, i_t, bos, eos, o_i, o_t, m_t = chunk_program(cu_seqlens, chunk_indices, BT)
    t0 = bos + i_t * BT
    n_valid = tl.minimum(eos - t0, BT)
    if I * 16 >= n_valid:
        return
    o16 = tl.arange(0, 16)
    # Block I's rows, BK channels a step, split at its first row r: against the earlier blocks' columns, one [16, BK]
    # × [BK, BT] dot (columns restricted to j < 16 I); against its own block, one dot at SOLVE_PREC (column factors
    # e^{G_r − G_j} ≤ e^SPAN) where the block decays by at most DIAG_SPAN over its rows (the largest over the
    # channels), else its rows against token c of the block, each pair's exponent formed directly. Aqk's rows are
    # stored where they belong, Akk's to the fp32 scratch Akk.
    rows = I * 16 + o16
    m_r = rows < n_valid
    m_col = ((o_i < I * 16) & m_t)[:, None]
    b_aq = tl.zeros([16, BT], dtype=tl.float32)
    b_ak = tl.zeros([16, BT], dtype=tl.float32)
    b_aqd = tl.zeros([16, 16], dtype=tl.float32)
    b_akd = tl.zeros([16, 16], dtype=tl.float32)
    for i_k in range(KT // BK):
        b_qs = chunk_rows(q, t0, rows, m_r, i_h, H, K, BK, i_k * BK)
        b_ks = chunk_rows(k, t0, rows, m_r, i_h, H, K, BK, i_k * BK)
        b_Gs = chunk_rows(G, t0, rows, m_r, i_hv, HV, K, BK, i_k * BK)
        b_Gr = token_row(G, t0, I * 16, n_valid, i_hv, HV, K, BK, i_k * BK)
        b_rs = tl.where(m_r[:, None], tl.exp(tl.where(m_r[:, None], b_Gs - b_Gr[None, :], 0.0)), 0.0)
        b_qr = b_qs * b_rs
        b_kr = b_ks * b_rs
        if I > 0:
            b_kc = chunk_rows(k, t0, o_i, m_t, i_h, H, K, BK, i_k * BK)
            b_Gc = chunk_rows(G, t0, o_i, m_t, i_hv, HV, K, BK, i_k * BK)
            b_col = tl.trans(tl.where(m_col, b_kc * tl.exp(tl.where(m_col, b_Gr[None, :] - b_Gc, 0.0)), 0.0))
            b_aq = mma(b_qr, b_col, b_aq, DOT_PREC)
            b_ak = mma(b_kr, b_col, b_ak, DOT_PREC)
        # the diagonal block's column factors, capped: a block beyond DIAG_SPAN is redone below
        b_cd = tl.trans(tl.where(m_r[:, None], b_ks * tl.exp(tl.minimum(
            tl.where(m_r[:, None], b_Gr[None, :] - b_Gs, 0.0), DIAG_SPAN)), 0.0))
        b_aqd = mma(b_qr, b_cd, b_aqd, SOLVE_PREC)
        b_akd = mma(b_kr, b_cd, b_akd, SOLVE_PREC)
    b_first = token_row(G, t0, I * 16, n_valid, i_hv, HV, K, KT)
    b_last = token_row(G, t0, tl.minimum(I * 16 + 15, n_valid - 1), n_valid, i_hv, HV, K, KT)
    if tl.max(b_first - b_last, 0) > DIAG_SPAN:
        b_q = chunk_rows(q, t0, rows, m_r, i_h, H, K, KT)
        b_k = chunk_rows(k, t0, rows, m_r, i_h, H, K, KT)
        b_G = chunk_rows(G, t0, rows, m_r, i_hv, HV, K, KT)
        b_aqd = tl.zeros([16, 16], dtype=tl.float32)
        b_akd = tl.zeros([16, 16], dtype=tl.float32)
        for c in range(16):
            m_j = (m_r & (o16 >= c) & (o16 * 0 + I * 16 + c < n_valid))[:, None]
            b_Gt = token_row(G, t0, I * 16 + c, n_valid, i_hv, HV, K, KT)
            b_E = tl.where(m_j, token_row(k, t0, I * 16 + c, n_valid, i_h, H, K, KT)[None, :]
                           * tl.exp(tl.where(m_j, b_G - b_Gt[None, :], 0.0)), 0.0)
            sel = o16[None, :] == c
            b_aqd += tl.where(sel, tl.sum(b_q * b_E, 1)[:, None], 0.0)
            b_akd += tl.where(sel & (o16 > c)[:, None], tl.sum(b_k * b_E, 1)[:, None], 0.0)
    p_r = ((t0 + rows) * HV + i_hv)[:, None] * BT
    m_off = m_r[:, None] & (o_i < I * 16)[None, :]
    tl.store(Aqk + p_r + o_i[None, :], cast_for_store(b_aq, Aqk, DOT_PREC),
             mask=m_r[:, None] & ((o_i // 16) != I)[None, :])
    tl.store(Aqk + p_r + I * 16 + o16[None, :], cast_for_store(tl.where(o16[None, :] <= o16[:, None], b_aqd, 0.0),
                                                             Aqk, DOT_PREC), mask=m_r[:, None])
    tl.store(Akk + p_r + o_i[None, :], b_ak, mask=m_off)
    # The diagonal block of T, (I + D)⁻¹ for D = diag(β) Akk's block, by forward substitution (row r of T − I is
    # −D_r − Σ_{l<r} D_rl (T − I)_l, rows l < r already in place), stored in place of Akk's block for the solve
    b_betaI = tl.load(beta + (t0 + rows) * HV + i_hv, mask=m_r, other=0.0).to(tl.float32)
    b_D = tl.where(o16[None, :] < o16[:, None], b_akd * b_betaI[:, None], 0.0)
    b_X = -b_D
    for r in range(1, 16):
        sel = (o16 == r)[:, None]
        b_dr = tl.sum(tl.where(sel, b_D, 0.0), 0)   # row r of D, indexed by l
        b_X = tl.where(sel, (-b_dr - tl.sum(b_dr[:, None] * b_X, 0))[None, :], b_X)
    b_X += (o16[:, None] == o16[None, :]).to(tl.float32)
    tl.store(Akk + p_r + I * 16 + o16[None, :], b_X, mask=m_r[:, None])


@triton.jit
def kda_solve_kernel(Akk, beta, Ai, cu_seqlens, chunk_indices, HV: tl.constexpr, BT: tl.constexpr,
                     DOT_PREC: tl.constexpr, SOLVE_PREC: tl.constexpr):
    """T = (I + A)⁻¹ per (chunk, value head), A = diag(β) Akk, from the scratch Akk [tokens, HV, BT] fp32: its blocks
    below the diagonal are Akk's, its diagonal 16 × 16 blocks already T's own, T_D = (I + D)⁻¹ (kda_intra_fwd_kernel;
    above, unwritten), merged with L = A − D (strictly block-lower) by common/wy.py's merge_block_inverses."""
    i_hv = tl.program_id(1)
    i_c, i_n, i_t, bos, eos, o_i, o_t, m_t = chunk_program(cu_seqlens, chunk_indices, BT)
    p_A = (o_t[:, None] * HV + i_hv) * BT + o_i[None, :]
    same_block = (o_i // 16)[:, None] == (o_i // 16)[None, :]
    below = (o_i // 16)[None, :] < (o_i // 16)[:, None]
    b_S = tl.load(Akk + p_A, mask=m_t[:, None] & (same_block | below), other=0.0)
    b_beta = tl.load(beta + o_t * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
    b_TD = tl.where(same_block & (o_i[None, :] <= o_i[:, None]), b_S, 0.0)
    b_T = merge_block_inverses(b_TD, tl.where(below, b_S * b_beta[:, None], 0.0), SOLVE_PREC)
    tl.store(Ai + p_A, cast_for_store(b_T, Ai, DOT_PREC), mask=m_t[:, None])


@triton.jit
def kda_intra_bwd_kernel(
    q, k, G, beta, dMP, dA, dq, dk, dG, dbeta_part, cu_seqlens, chunk_indices,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    DOT_PREC: tl.constexpr, SOLVE_PREC: tl.constexpr, DIAG_SPAN: tl.constexpr,
):
    # one program per (chunk, value head, BK channels, 16-row block I): every term is per channel but dβ's, a partial
    # sum here; a row block's gradients take its own block, the columns before it (row side) and the rows after it
    # (column side)
    i_hv, i_kb, I = tl.program_id(1), tl.program_id(2) // (BT // 16), tl.program_id(2) % (BT // 16)
    i_h = i_hv // (HV // H)
    k0 = i_kb * BK
    i_c, i_n, i_t, bos, eos, o_i, o_t, m_t = chunk_program(cu_seqlens, chunk_indices, BT)
    t0 = bos + i_t * BT
    n_valid = tl.minimum(eos - t0, BT)
    if I * 16 >= n_valid:
        return
    o16 = tl.arange(0, 16)
    o_k = k0 + tl.arange(0, BK)
    b_q = chunk_rows(q, t0, o_i, m_t, i_h, H, K, BK, k0)  # the whole chunk: the other side of the off-diagonal dots
    b_k = chunk_rows(k, t0, o_i, m_t, i_h, H, K, BK, k0)
    b_G = chunk_rows(G, t0, o_i, m_t, i_hv, HV, K, BK, k0)
    b_beta = tl.load(beta + o_t * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
    rows = I * 16 + o16
    m_r = rows < n_valid
    b_qI = chunk_rows(q, t0, rows, m_r, i_h, H, K, BK, k0)
    b_kI = chunk_rows(k, t0, rows, m_r, i_h, H, K, BK, k0)
    b_GI = chunk_rows(G, t0, rows, m_r, i_hv, HV, K, BK, k0)
    p_rI = ((t0 + rows) * HV + i_hv) * BT  # the block's rows of M = dM_P or dA [tokens, HV, BT]
    b_dqP = tl.zeros([16, BK], dtype=tl.float32)
    b_R = tl.zeros([16, BK], dtype=tl.float32)
    b_dkP = tl.zeros([16, BK], dtype=tl.float32)
    b_C = tl.zeros([16, BK], dtype=tl.float32)
    # The diagonal block. Where it decays by at most DIAG_SPAN over its rows (the largest over these channels):
    # four dots at SOLVE_PREC, the row side split at its first row, the column side at its last (every factor
    # within e^±SPAN; the precision keeps dG's exact cancellations, e.g. q_i·dM_ii·k_i on both sides, as the
    # pairwise form does). Beyond, against its token c: rows at or after c take c as their column j (row side),
    # rows at or before c as their row i (column side), one exponent serving both (G_row − G_c after c,
    # G_c − G_row before). First, so that the accumulators keep its own layout rather than the dots'
    b_first = token_row(G, t0, I * 16, n_valid, i_hv, HV, K, BK, k0)
    b_last = token_row(G, t0, tl.minimum(I * 16 + 15, n_valid - 1), n_valid, i_hv, HV, K, BK, k0)
    b_betaI = tl.load(beta + (t0 + rows) * HV + i_hv, mask=m_r, other=0.0).to(tl.float32)
    # the block's row factors e^{G_i − G_first} and column factors e^{G_last − G_j}, both ≤ 1
    b_rs = tl.where(m_r[:, None], tl.exp(tl.where(m_r[:, None], b_GI - b_first[None, :], 0.0)), 0.0)
    b_cs = tl.where(m_r[:, None], tl.exp(tl.where(m_r[:, None], b_last[None, :] - b_GI, 0.0)), 0.0)
    if tl.max(b_first - b_last, 0) <= DIAG_SPAN:
        m_d = m_r[:, None] & m_r[None, :]
        p_MI = p_rI[:, None] + I * 16 + o16[None, :]   # M_ij, i and j in the block
        p_MIt = ((t0 + rows)[None, :] * HV + i_hv) * BT + rows[:, None]   # [j, i] = M_ij
        b_kr = tl.where(m_r[:, None], b_kI * tl.exp(tl.where(m_r[:, None], b_first[None, :] - b_GI, 0.0)), 0.0)
        b_dqP += b_rs * mm(tl.load(dMP + p_MI, mask=m_d, other=0.0), b_kr, SOLVE_PREC)
        b_R += b_rs * mm(tl.load(dA + p_MI, mask=m_d, other=0.0), b_kr, SOLVE_PREC)
        b_ei = tl.where(m_r[:, None], tl.exp(tl.where(m_r[:, None], b_GI - b_last[None, :], 0.0)), 0.0)
        b_dkP += b_cs * mm(tl.load(dMP + p_MIt, mask=m_d, other=0.0), b_qI * b_ei, SOLVE_PREC)
        b_C += b_cs * mm(tl.load(dA + p_MIt, mask=m_d, other=0.0) * b_betaI[None, :], b_kI * b_ei, SOLVE_PREC)
    else:
        for c in range(16):
            t_c = t0 + I * 16 + c
            m_c = o16 * 0 + I * 16 + c < n_valid
            m_lo = m_r & (o16 >= c) & m_c
            m_hi = m_r & (o16 <= c) & m_c
            b_kc = token_row(k, t0, I * 16 + c, n_valid, i_h, H, K, BK, k0)
            b_Gc = token_row(G, t0, I * 16 + c, n_valid, i_hv, HV, K, BK, k0)
            b_D = tl.where(m_lo[:, None], b_GI - b_Gc[None, :], b_Gc[None, :] - b_GI)
            b_E = tl.exp(tl.where((m_lo | m_hi)[:, None], b_D, 0.0))
            b_Ek = b_E * b_kc[None, :]
            p_c = (t_c * HV + i_hv) * BT + I * 16  # token c's row of M, from the block's first column
            b_dqP += tl.load(dMP + p_rI + I * 16 + c, mask=m_lo, other=0.0)[:, None] * b_Ek
            b_R += tl.load(dA + p_rI + I * 16 + c, mask=m_lo, other=0.0)[:, None] * b_Ek
            b_dkP += tl.load(dMP + p_c + o16, mask=m_hi, other=0.0)[:, None] * b_E \
                * token_row(q, t0, I * 16 + c, n_valid, i_h, H, K, BK, k0)[None, :]
            b_beta_c = tl.load(beta + t_c * HV + i_hv, mask=I * 16 + c < n_valid, other=0.0).to(tl.float32)
            b_C += (tl.load(dA + p_c + o16, mask=m_hi, other=0.0) * b_beta_c)[:, None] * b_Ek
    # Row side, earlier blocks (split at r = 16 I): dq_P = Σ_j dM_P,ij k_j e^{G_i − G_j}; R = Σ_j dA_ij k_j ...
    if I > 0:
        m_col = ((o_i < I * 16) & m_t)[:, None]
        b_col = tl.where(m_col, b_k * tl.exp(tl.where(m_col, b_first[None, :] - b_G, 0.0)), 0.0)
        m_M = m_r[:, None] & (o_i < I * 16)[None, :]
        b_dqP += b_rs * mm(tl.load(dMP + p_rI[:, None] + o_i[None, :], mask=m_M, other=0.0), b_col, DOT_PREC)
        b_R += b_rs * mm(tl.load(dA + p_rI[:, None] + o_i[None, :], mask=m_M, other=0.0), b_col, DOT_PREC)
    # Column side, later blocks (split at r = the block's last row): dk_P = Σ_i dM_P,ij q_i e^{G_i − G_j};
    # C = Σ_i β_i dA_ij k_i e^{G_i − G_j}. Mᵀ is read from memory with transposed addresses.
    if I < BT // 16 - 1:
        m_row = (o_i > I * 16 + 15) & m_t
        b_e = tl.where(m_row[:, None], tl.exp(tl.where(m_row[:, None], b_G - b_last[None, :], 0.0)), 0.0)
        p_Mt = (o_t[None, :] * HV + i_hv) * BT + rows[:, None]
        m_Mt = m_r[:, None] & m_row[None, :]
        b_dAt = tl.load(dA + p_Mt, mask=m_Mt, other=0.0) * b_beta[None, :]
        b_dkP += b_cs * mm(tl.load(dMP + p_Mt, mask=m_Mt, other=0.0), b_q * b_e, DOT_PREC)
        b_C += b_cs * mm(b_dAt, b_k * b_e, DOT_PREC)
    # Add to the state-side parts chunk_bwd.py's kernel wrote (fp32, per value head)
    m_rk = m_r[:, None] & (o_k < K)[None, :]
    p_k = ((t0 + rows)[:, None] * HV + i_hv) * K + o_k[None, :]
    b_bR = b_R * b_betaI[:, None]
    tl.store(dq + p_k, tl.load(dq + p_k, mask=m_rk, other=0.0) + b_dqP, mask=m_rk)
    tl.store(dk + p_k, tl.load(dk + p_k, mask=m_rk, other=0.0) + b_dkP + b_bR + b_C, mask=m_rk)
    b_dG = b_qI * b_dqP - b_kI * b_dkP + b_kI * (b_bR - b_C)
    tl.store(dG + p_k, tl.load(dG + p_k, mask=m_rk, other=0.0) + b_dG, mask=m_rk)
    NK = tl.num_programs(2) // (BT // 16)
    tl.store(dbeta_part + ((t0 + rows) * HV + i_hv) * NK + i_kb, tl.sum(b_kI * b_R, 1), mask=m_r)


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
        KT = tile(K)
        akk = torch.empty(TT, HV, BT, dtype=torch.float32, device=k.device)
        kda_intra_fwd_kernel[(layout.num_chunks, HV, BT // 16)](
            q, k, G, beta, Aqk, akk, layout.cu_seqlens, layout.chunk_indices, H=H, HV=HV, K=K, BT=BT,
            KT=KT, BK=min(KT, INTRA_BK),
            DOT_PREC=tuning.dot(kda_intra_fwd_kernel, dot_prec), SOLVE_PREC=solve_precision(k.dtype),
            DIAG_SPAN=DIAG_SPAN, **tuning.launch("kda_intra_fwd"))
        kda_solve_kernel[(layout.num_chunks, HV)](
            akk, beta, Ai, layout.cu_seqlens, layout.chunk_indices, HV=HV, BT=BT,
            DOT_PREC=tuning.dot(kda_solve_kernel, dot_prec), SOLVE_PREC=solve_precision(k.dtype),
            **tuning.launch("kda_solve"))
    return Ai, Aqk


def kda_intra_bwd(q, k, G, beta, dMP, dA, dq, dk, dG, dbeta, layout: ChunkLayout, *, dot_prec: str,
                  tuning: Tuning = DEFAULT_TUNING) -> None:
    """Adds the intra-chunk gradients into dq, dk [tokens, HV, K], dG [tokens, HV, K] and dbeta [tokens, HV] (all
    fp32, in place) from dMP = scale·dO δᵀ and dA [tokens, HV, BT] (fp32, masked to the chunk's triangles). The key
    channels split over programs of INTRA_BK each; dβ sums their partial sums."""
    TT, H, K = k.shape
    HV = beta.shape[1]
    if layout.num_chunks:
        BK = tile(K, INTRA_BK)
        NK = triton.cdiv(K, BK)
        dbeta_part = torch.empty(TT, HV, NK, dtype=torch.float32, device=k.device)
        kda_intra_bwd_kernel[(layout.num_chunks, HV, NK * (layout.chunk_size // 16))](
            q, k, G, beta, dMP, dA, dq, dk, dG, dbeta_part, layout.cu_seqlens, layout.chunk_indices, H=H, HV=HV,
            K=K, BT=layout.chunk_size, BK=BK, DOT_PREC=tuning.dot(kda_intra_bwd_kernel, dot_prec),
            SOLVE_PREC=solve_precision(k.dtype), DIAG_SPAN=DIAG_SPAN, **tuning.launch("kda_intra_bwd"))
        dbeta += dbeta_part.sum(-1)
