"""Chunked IPLR delta rule, backward: rerun the forward state pass for the chunk-start states S and the a-reads X
(from the stored T; nothing else is recomputed); run the shared reverse state pass (common/state_pass.py, with b in
the role of k and w = −T A formed from T and a: it yields dS' per chunk, Y = Tᵀ dX and dh0); then two chunk-parallel
kernels, one per side of the chunk's products, that write the final gradients in the inputs' dtypes.

Per chunk, X = T R with R = A S + strict(A Kᵀ) V and T = (I − strict(A Bᵀ))⁻¹, i.e. X = strict(A Bᵀ) X + R. With dX
the total gradient of X (the reverse pass's dδ), Y = Tᵀ dX is the gradient of R, Y Xᵀ that of strict(A Bᵀ), so no
T-sandwich is ever formed. M = [j ≤ i], strict = [j < i]; S the chunk-start state, dS' the chunk-end state's gradient:
    dq = scale (dO Sᵀ + (dO Xᵀ ⊙ M) B + (dO Vᵀ ⊙ M) K)          da = Y Sᵀ + strict(Y Xᵀ) B + strict(Y Vᵀ) K
    db = X dS'ᵀ + scale (dO Xᵀ ⊙ M)ᵀ Q + strict(Y Xᵀ)ᵀ A        dk = V dS'ᵀ + scale (dO Vᵀ ⊙ M)ᵀ Q + strict(Y Vᵀ)ᵀ A
    dv = K dS' + scale (Q Kᵀ ⊙ M)ᵀ dO + strict(A Kᵀ)ᵀ Y
(and the reverse pass's dS_0 = dS' + scale Qᵀ dO + Aᵀ Y). dq and da share their form (dO and Y against S, X and V),
so do db and dk (X and V against dS', dO and Y): the query-side kernel forms the first pair, the key-side kernel the
second and dv. Each transposed [BT, BT] product (X dOᵀ, X Yᵀ, K Qᵀ, K Aᵀ, ...) is a dot of its own from loaded tiles,
never a tl.trans of a dot result (the Hopper miscompile pattern of fla #640, see common/scratch.py). Tiles that feed
only dots are loaded as stored (no fp32 copy): the dots take them, transposed too, from shared memory (precision.mm).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.chunking import ChunkLayout, chunk_program
from ..common.launch import tile
from ..common.precision import cast_for_store, mm, mma, operand_dtype, raw_precision, sixteen_bit_dots
from ..common.state_pass import state_pass_bwd
from ..common.tuning import DEFAULT_TUNING, Tuning
from .chunk_fwd import iplr_state_pass_fwd

# Value columns per step of the two kernels' V loops (capped at V's power of two) when their dots take 16-bit
# operands and K ≤ 128; 32 otherwise (fp32 tiles, or K = 256 ones, at 64 columns overflow Hopper's 227 KiB of shared
# memory: compile_report.py). 64 against 32 for the key side: 0.440 ms against 0.570 (H100, bf16 B8 T2048 H16
# K=V=128).
BWD_BV = {"query": 64, "key": 64}


@triton.jit
def _value_step(state, x, v, do, y, i_v, i_h, i_hc, o_t, m_t, o_k, m_k, H: tl.constexpr, K: tl.constexpr,
                V: tl.constexpr, BV: tl.constexpr):
    """Step i_v of a kernel's V loop: the chunk-start state's (query side: S; key side: dS') [BK, BV] tile and the
    [BT, BV] tiles of X, V, dO and Y, loaded as stored, with their offsets p_v and mask m_tv (for dv's store)."""
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_tv = m_t[:, None] & m_v[None, :]
    p_v = (o_t[:, None] * H + i_h) * V + o_v[None, :]
    b_state = tl.load(state + (i_hc * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :],
                      mask=m_k[:, None] & m_v[None, :], other=0.0)
    b_x = tl.load(x + p_v, mask=m_tv, other=0.0)
    b_v = tl.load(v + p_v, mask=m_tv, other=0.0)
    b_do = tl.load(do + p_v, mask=m_tv, other=0.0)
    b_y = tl.load(y + p_v, mask=m_tv, other=0.0)
    return b_state, b_x, b_v, b_do, b_y, p_v, m_tv


@triton.jit
def iplr_bwd_query_kernel(
    q, k, b, x, v, h, do, y, dq, da, cu_seqlens, chunk_indices, chunk_offsets, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """dq = scale (dO Sᵀ + (dO Xᵀ ⊙ M) B + (dO Vᵀ ⊙ M) K),  da = Y Sᵀ + strict(Y Xᵀ) B + strict(Y Vᵀ) K."""
    i_h = tl.program_id(1)
    i_c, i_n, i_t, bos, eos, o_i, o_t, m_t = chunk_program(cu_seqlens, chunk_indices, BT)
    i_hc = tl.load(chunk_offsets + i_n).to(tl.int64) + i_t
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    b_dq = tl.zeros([BT, BK], dtype=tl.float32)   # dO Sᵀ
    b_da = tl.zeros([BT, BK], dtype=tl.float32)   # Y Sᵀ
    b_dOX = tl.zeros([BT, BT], dtype=tl.float32)  # dO Xᵀ
    b_dOV = tl.zeros([BT, BT], dtype=tl.float32)  # dO Vᵀ
    b_YX = tl.zeros([BT, BT], dtype=tl.float32)   # Y Xᵀ
    b_YV = tl.zeros([BT, BT], dtype=tl.float32)   # Y Vᵀ
    for i_v in range(tl.cdiv(V, BV)):
        b_h, b_x, b_v, b_do, b_y, _, _ = _value_step(h, x, v, do, y, i_v, i_h, i_hc, o_t, m_t, o_k, m_k, H, K, V, BV)
        b_dq = mma(b_do, tl.trans(b_h), b_dq, DOT_PREC)
        b_da = mma(b_y, tl.trans(b_h), b_da, DOT_PREC)
        b_dOX = mma(b_do, tl.trans(b_x), b_dOX, DOT_PREC)
        b_dOV = mma(b_do, tl.trans(b_v), b_dOV, DOT_PREC)
        b_YX = mma(b_y, tl.trans(b_x), b_YX, DOT_PREC)
        b_YV = mma(b_y, tl.trans(b_v), b_YV, DOT_PREC)
    m_tk = m_t[:, None] & m_k[None, :]
    p_k = (o_t[:, None] * H + i_h) * K + o_k[None, :]
    b_b = tl.load(b + p_k, mask=m_tk, other=0.0)
    b_k = tl.load(k + p_k, mask=m_tk, other=0.0)
    m_M = o_i[:, None] >= o_i[None, :]
    m_S = o_i[:, None] > o_i[None, :]
    b_dq = mma(tl.where(m_M, b_dOX, 0.0), b_b, b_dq, DOT_PREC)
    b_dq = mma(tl.where(m_M, b_dOV, 0.0), b_k, b_dq, DOT_PREC)
    tl.store(dq + p_k, cast_for_store(b_dq * scale, dq, DOT_PREC), mask=m_tk)
    b_da = mma(tl.where(m_S, b_YX, 0.0), b_b, b_da, DOT_PREC)
    b_da = mma(tl.where(m_S, b_YV, 0.0), b_k, b_da, DOT_PREC)
    tl.store(da + p_k, cast_for_store(b_da, da, DOT_PREC), mask=m_tk)


@triton.jit
def iplr_bwd_key_kernel(
    q, k, a, x, v, dh, do, y, dk, db, dv, cu_seqlens, chunk_indices, chunk_offsets, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DOT_PREC: tl.constexpr, RAW_PREC: tl.constexpr,
):
    """db = X dS'ᵀ + scale (X dOᵀ ⊙ Mᵀ) Q + strictᵀ(X Yᵀ) A,  dk = V dS'ᵀ + scale (V dOᵀ ⊙ Mᵀ) Q + strictᵀ(V Yᵀ) A,
    dv = K dS' + scale (K Qᵀ ⊙ Mᵀ) dO + strictᵀ(K Aᵀ) Y  (Mᵀ, strictᵀ: the masks j ≥ i, j > i of the [i, j] tiles)."""
    i_h = tl.program_id(1)
    i_c, i_n, i_t, bos, eos, o_i, o_t, m_t = chunk_program(cu_seqlens, chunk_indices, BT)
    i_hc = tl.load(chunk_offsets + i_n).to(tl.int64) + i_t
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    m_tk = m_t[:, None] & m_k[None, :]
    p_k = (o_t[:, None] * H + i_h) * K + o_k[None, :]
    b_q = tl.load(q + p_k, mask=m_tk, other=0.0)
    b_k = tl.load(k + p_k, mask=m_tk, other=0.0)
    b_a = tl.load(a + p_k, mask=m_tk, other=0.0)
    m_Mt = o_i[:, None] <= o_i[None, :]
    m_St = o_i[:, None] < o_i[None, :]
    b_Pt = tl.where(m_Mt, mm(b_k, tl.trans(b_q), RAW_PREC), 0.0) * scale  # scale (Q Kᵀ ⊙ M)ᵀ
    b_Lt = tl.where(m_St, mm(b_k, tl.trans(b_a), RAW_PREC), 0.0)          # strict(A Kᵀ)ᵀ
    b_db = tl.zeros([BT, BK], dtype=tl.float32)   # X dS'ᵀ
    b_dk = tl.zeros([BT, BK], dtype=tl.float32)   # V dS'ᵀ
    b_XdO = tl.zeros([BT, BT], dtype=tl.float32)  # X dOᵀ
    b_VdO = tl.zeros([BT, BT], dtype=tl.float32)  # V dOᵀ
    b_XY = tl.zeros([BT, BT], dtype=tl.float32)   # X Yᵀ
    b_VY = tl.zeros([BT, BT], dtype=tl.float32)   # V Yᵀ
    for i_v in range(tl.cdiv(V, BV)):
        b_dh, b_x, b_v, b_do, b_y, p_v, m_tv = _value_step(dh, x, v, do, y, i_v, i_h, i_hc, o_t, m_t, o_k, m_k, H,
                                                           K, V, BV)
        b_db = mma(b_x, tl.trans(b_dh), b_db, DOT_PREC)
        b_dk = mma(b_v, tl.trans(b_dh), b_dk, DOT_PREC)
        b_XdO = mma(b_x, tl.trans(b_do), b_XdO, DOT_PREC)
        b_VdO = mma(b_v, tl.trans(b_do), b_VdO, DOT_PREC)
        b_XY = mma(b_x, tl.trans(b_y), b_XY, DOT_PREC)
        b_VY = mma(b_v, tl.trans(b_y), b_VY, DOT_PREC)
        b_dv = mma(b_Lt, b_y, mma(b_Pt, b_do, mm(b_k, b_dh, DOT_PREC), DOT_PREC), DOT_PREC)
        tl.store(dv + p_v, cast_for_store(b_dv, dv, DOT_PREC), mask=m_tv)
    b_db = mma(tl.where(m_Mt, b_XdO, 0.0) * scale, b_q, b_db, DOT_PREC)
    b_db = mma(tl.where(m_St, b_XY, 0.0), b_a, b_db, DOT_PREC)
    tl.store(db + p_k, cast_for_store(b_db, db, DOT_PREC), mask=m_tk)
    b_dk = mma(tl.where(m_Mt, b_VdO, 0.0) * scale, b_q, b_dk, DOT_PREC)
    b_dk = mma(tl.where(m_St, b_VY, 0.0), b_a, b_dk, DOT_PREC)
    tl.store(dk + p_k, cast_for_store(b_dk, dk, DOT_PREC), mask=m_tk)


def iplr_bwd_chunks(q, k, v, a, b, x, h, dh, do, y, scale: float, layout: ChunkLayout, *, dot_prec: str,
                    tuning: Tuning = DEFAULT_TUNING):
    """The two chunk-parallel kernels → (dq, dk, dv, da, db), each in its input's dtype (final); their dots in
    dot_prec (the forward's); tuning: the launch choices (common/tuning.py)."""
    TT, H, K = q.shape
    V = v.shape[-1]
    if K > 256:
        raise ValueError(f"K={K} > 256 is not supported by the chunked backward")
    dq, dk, da, db = (torch.empty_like(t) for t in (q, k, a, b))
    dv = torch.empty_like(v)
    if layout.num_chunks:
        wide = sixteen_bit_dots(dot_prec) and K <= 128
        bv = {kernel: tile(V, bv if wide else 32) for kernel, bv in BWD_BV.items()}
        common = dict(H=H, K=K, V=V, BT=layout.chunk_size, BK=tile(K))
        grid = (layout.num_chunks, H)
        iplr_bwd_query_kernel[grid](
            q, k, b, x, v, h, do, y, dq, da, layout.cu_seqlens, layout.chunk_indices, layout.chunk_offsets, scale,
            BV=bv["query"], DOT_PREC=tuning.dot(iplr_bwd_query_kernel, dot_prec), **common,
            **tuning.launch("iplr_bwd_query"))
        iplr_bwd_key_kernel[grid](
            q, k, a, x, v, dh, do, y, dk, db, dv, layout.cu_seqlens, layout.chunk_indices, layout.chunk_offsets,
            scale, BV=bv["key"], DOT_PREC=tuning.dot(iplr_bwd_key_kernel, dot_prec), RAW_PREC=raw_precision(q.dtype),
            **common, **tuning.launch("iplr_bwd_key"))
    return dq, dk, dv, da, db


def chunk_iplr_delta_rule_bwd(q, k, v, a, b, scale: float, initial_state, Ai, Ak, do, dht, layout: ChunkLayout, *,
                              dot_prec: str, tuning: Tuning = DEFAULT_TUNING):
    """Flattened contiguous inputs (as chunk_iplr_delta_rule_fwd), the saved T and strict(A Kᵀ) tiles Ai, Ak, do
    [tokens, H, V] and dht (or None) → (dq, dk, dv, da, db [tokens, H, *] in the inputs' dtypes, dh0 [N, H, K, V]
    fp32 or None); dot_prec, tuning: the forward's DOT_PREC and launch choices."""
    h, x, _ = iplr_state_pass_fwd(k, v, a, b, Ai, Ak, initial_state, False, layout, dot_prec=dot_prec, tuning=tuning)
    # The shared reverse state pass: X plays δ, b plays k, w = −T A comes from T and a; it hands back Y = Tᵀ dX.
    dh, y, dh0 = state_pass_bwd(q, b, None, do, dht, scale, initial_state is not None, layout, Ai, a=a,
                                dot_prec=dot_prec, local_prec=dot_prec, dh_dtype=operand_dtype(q.dtype, dot_prec),
                                dv_dtype=operand_dtype(q.dtype, dot_prec), tuning=tuning)
    dq, dk, dv, da, db = iplr_bwd_chunks(q, k, v, a, b, x, h, dh, do, y, scale, layout, dot_prec=dot_prec,
                                         tuning=tuning)
    return dq, dk, dv, da, db, dh0
