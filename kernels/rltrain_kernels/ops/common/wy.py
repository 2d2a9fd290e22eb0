"""WY / UT-transform representation of a chunk of gated delta-rule updates (forward).

Within a chunk (local index i, chunk-local cumulative gate G_i, γ_i = exp(G_i)) the updates compose to
    S_i = γ_i S_0 + Σ_{j≤i} exp(G_i − G_j) k_j δ_jᵀ,   δ = u − w S_0,
with  A_ij = β_i exp(G_i − G_j) k_iᵀk_j (i > j, else 0),  T = (I + A)⁻¹  (unit lower triangular),
      w = T diag(β γ) K,   u = T diag(β) V.
This module builds A and solves for T in registers (forward substitution, one row per step). T is stored
([tokens, heads, chunk]); w and u are never stored: the state passes form their products from T (common/state_pass.py),
and the backward reuses T without the solve.

Dot precision: common/precision.py (recurrence_dot_precision: this kernel, its backward and the state passes take
the op's recurrence DOT_PREC as `dot_prec`, which may be tf32 where the rest runs bf16). T feeds only those dots, so
it is stored in the dots' operand dtype (operand_dtype(k.dtype, dot_prec): bf16 with bf16 dots, which round it so
anyway).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .chunking import ChunkLayout, chunk_program
from .precision import (
    cast_for_store,
    mm,
    operand_dtype,
    raw_precision,
    solve_precision,
)
from .tuning import DEFAULT_TUNING, Tuning


@triton.jit
def solve_unit_lower(b_A, BT: tl.constexpr, SOLVE_PREC: tl.constexpr):
    """(I + A)⁻¹ for a strictly lower triangular [BT, BT] fp32 tile A (BT ≤ 64, a multiple of 16).

    1. The BT/16 diagonal 16×16 blocks D, gathered into a [BT/16, 16, 16] tile, inverted together by forward
       substitution (15 steps, each a masked reduction over that tile: a quarter of the [BT, BT] tile's work):
       row i of T_D − I is −D_i − Σ_{l<i} D_il (T_D − I)_l, rows l < i already in place.
    2. With L = A − D (strictly block-lower) and M = T_D L: I + A = (I + D)(I + M), M⁴ = 0, so
       T = (I + M)⁻¹ T_D = (I − M)(I + M²) T_D: four [BT, BT] dots.
    """
    NB: tl.constexpr = BT // 16
    o_i = tl.arange(0, BT)
    o_r = tl.arange(0, 16)
    same_block = (o_i // 16)[:, None] == (o_i // 16)[None, :]
    # D3[b, r, c] = A[16b + r, 16b + c]: zero the off-diagonal blocks, then sum each row over the column blocks
    b_T3 = -tl.sum(tl.reshape(tl.where(same_block, b_A, 0.0), (NB, 16, NB, 16)), 2)
    for r in range(1, 16):
        sel = (o_r == r)[None, :, None]
        row = tl.sum(tl.where(sel, b_T3, 0.0), 1)                  # [NB, 16]: row r of every block
        row = row + tl.sum(row[:, :, None] * b_T3, 1)
        b_T3 = tl.where(sel, row[:, None, :], b_T3)
    b_T3 = b_T3 + (o_r[:, None] == o_r[None, :]).to(tl.float32)[None, :, :]
    # back to [BT, BT], block diagonal: repeat each block along the column blocks, keep the diagonal one
    b_TD = tl.reshape(tl.broadcast_to(b_T3[:, :, None, :], (NB, 16, NB, 16)), (BT, BT))
    b_TD = tl.where(same_block, b_TD, 0.0)
    return merge_block_inverses(b_TD, tl.where(same_block, 0.0, b_A), SOLVE_PREC)


@triton.jit
def merge_block_inverses(b_TD, b_L, SOLVE_PREC: tl.constexpr):
    """(I + D + L)⁻¹ from T_D = (I + D)⁻¹ (block diagonal, 16 × 16 blocks) and L (strictly block-lower), [BT, BT]
    fp32, BT ≤ 64: with M = T_D L, I + D + L = (I + D)(I + M) and M⁴ = 0, so the inverse is (I − M)(I + M²) T_D."""
    b_M = tl.dot(b_TD, b_L, input_precision=SOLVE_PREC)
    b_X = b_TD + tl.dot(tl.dot(b_M, b_M, input_precision=SOLVE_PREC), b_TD, input_precision=SOLVE_PREC)
    return b_X - tl.dot(b_M, b_X, input_precision=SOLVE_PREC)


@triton.jit
def gated_wy_fwd_kernel(
    k, beta, G, Ai, cu_seqlens, chunk_indices,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, USE_G: tl.constexpr,
    DOT_PREC: tl.constexpr, RAW_PREC: tl.constexpr, SOLVE_PREC: tl.constexpr,
):
    i_hv = tl.program_id(1)
    i_h = i_hv // (HV // H)
    i_c, i_n, i_t, bos, eos, o_i, o_t, m_t = chunk_program(cu_seqlens, chunk_indices, BT)
    b_beta = tl.load(beta + o_t * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
    if USE_G:
        b_G = tl.load(G + o_t * HV + i_hv, mask=m_t, other=0.0)
    else:
        b_G = tl.zeros([BT], dtype=tl.float32)
    p_Ai = Ai + (o_t[:, None] * HV + i_hv) * BT + o_i[None, :]
    b_A = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        b_k = tl.load(k + (o_t[:, None] * H + i_h) * K + o_k[None, :],
                      mask=m_t[:, None] & (o_k < K)[None, :], other=0.0).to(tl.float32)
        b_A += mm(b_k, tl.trans(b_k), RAW_PREC)
    m_A = (o_i[:, None] > o_i[None, :]) & m_t[:, None] & m_t[None, :]
    b_A = tl.where(m_A, b_A * b_beta[:, None] * tl.exp(tl.where(m_A, b_G[:, None] - b_G[None, :], 0.0)), 0.0)
    b_T = solve_unit_lower(b_A, BT, SOLVE_PREC)
    tl.store(p_Ai, cast_for_store(b_T, Ai, DOT_PREC), mask=m_t[:, None])


def gated_wy_fwd(k, beta, G, layout: ChunkLayout, *, dot_prec: str, tuning: Tuning = DEFAULT_TUNING):
    """k [tokens, H, K], beta/G [tokens, HV] (G fp32 chunk-local cumsum or None) → Ai [tokens, HV, BT] = T in
    operand_dtype(k.dtype, dot_prec); dot_prec: the recurrence's DOT_PREC (precision.recurrence_dot_precision);
    tuning: the launch choices (common/tuning.py)."""
    TT, H, K = k.shape
    HV = beta.shape[1]
    BT = layout.chunk_size
    if BT % 16 or not 16 <= BT <= 64:
        raise ValueError(f"chunk_size must be 16, 32, 48 or 64 (the solve works in 16-row blocks), got {BT}")
    Ai = torch.empty(TT, HV, BT, dtype=operand_dtype(k.dtype, dot_prec), device=k.device)
    if layout.num_chunks:
        gated_wy_fwd_kernel[(layout.num_chunks, HV)](
            k, beta, G, Ai, layout.cu_seqlens, layout.chunk_indices, H=H, HV=HV, K=K, BT=BT,
            BK=min(64, triton.next_power_of_2(K)), USE_G=G is not None,
            DOT_PREC=tuning.dot(gated_wy_fwd_kernel, dot_prec),
            RAW_PREC=raw_precision(k.dtype), SOLVE_PREC=solve_precision(k.dtype), **tuning.launch("wy_fwd"))
    return Ai
