"""Chunked IPLR delta rule, backward: recompute w, u (from the stored T), the chunk-start states S and the a-reads
X; run the shared reverse state pass (common/state_pass.py, with b in the role of k and our w = −T A: it yields
dS' per chunk, dX and dh0); then the output/state pass below (dq, dk, db, dv, dw) and the WY backward (da, and
the WY parts of dk, db, dv). The kernels that finish a gradient write it in its input's dtype (no cast pass after).

Per chunk (M = [j ≤ i], strict = i > j, S the chunk-start state, dS' the gradient of the chunk-end state, dX the
total gradient of X from the state pass; W = T A = −w so that X = W S + u):
    dq = scale (dO Sᵀ + (dO Xᵀ ⊙ M) B + (dO Vᵀ ⊙ M) K)
    db = scale (dO Xᵀ ⊙ M)ᵀ Q + X dS'ᵀ + (dM_ab)ᵀ A,    dk = scale (dO Vᵀ ⊙ M)ᵀ Q + V dS'ᵀ + (dM_ak)ᵀ A
    dv = scale (Q Kᵀ ⊙ M)ᵀ dO + K dS' + strict(A Kᵀ)ᵀ Tᵀ dX,     dW = dX Sᵀ
    da = Tᵀ dW + dM_ab B + dM_ak K,  with  dT = dW Aᵀ + dX Vᵀ strict(A Kᵀ)ᵀ,
    dM_ab = strict(Tᵀ dT Tᵀ)  (T = (I − M_ab)⁻¹),   dM_ak = strict(Tᵀ dX Vᵀ)
No transposed [BT, BT] product is a tl.trans of a dot result (the Hopper miscompile pattern of fla #640, see
common/wy_bwd.py): each is accumulated as its own dot from loaded tiles, or in the WY backward, with
common/scratch.py's TRANSPOSE_VIA_SCRATCH, goes through a scratch tile. Tiles that feed only dots are loaded as stored
(no fp32 copy): the dots take them, transposed too, from shared memory (common/precision.py mm).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.chunking import ChunkLayout
from ..common.launch import launch
from ..common.state_pass import state_pass_bwd
from ..common.precision import (cast_for_store, iplr_dot_precision, iplr_operand_dtype, mm, mma, raw_precision,
                                sixteen_bit_dots)
from ..common.scratch import scratch_tiles, transpose_via_scratch
from .chunk_fwd import iplr_state_pass_fwd, iplr_wy_fwd

# Value columns per step of the two output-backward kernels' V loops (capped at V's power of two) when their dots take
# 16-bit operands: 64 for both, 0.83 → 0.75 ms at bf16 B8 T2048 H16 K=V=128 against 32 (H100, 2026-11-24, with the
# dk/db kernel at 4w/2s; launch.py has their warps and stages). tf32 / ieee dots (fp16, fp32 inputs) and K > 128 keep
# 32: fp32 tiles at 64 columns, or K = 256 bf16 ones, need 288 / 337 KiB of shared memory at 3 stages, over Hopper's
# 227 (compile_report.py); at K > 128 the dq/dw/dv kernel also runs at most 2 stages (fp32 tiles at K = 256: 273 KiB
# at 3 stages, 177 at 2).
OUTPUT_BWD_BV = {"dqwv": 64, "dkb": 64}


@triton.jit
def iplr_output_bwd_dqwv_kernel(
    q, k, v, b, x, h, dh, do, dx, dq, dv, dw, cu_seqlens, chunk_indices, chunk_offsets, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DOT_PREC: tl.constexpr, RAW_PREC: tl.constexpr,
):
    """dq = scale (dO Sᵀ + (dO Xᵀ ⊙ M) B + (dO Vᵀ ⊙ M) K), dW = dX Sᵀ, dv = scale (Q Kᵀ ⊙ M)ᵀ dO + K dS'."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_n = tl.load(chunk_indices + i_c * 2)
    i_t = tl.load(chunk_indices + i_c * 2 + 1)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    i_hc = tl.load(chunk_offsets + i_n).to(tl.int64) + i_t
    o_i, o_k = tl.arange(0, BT), tl.arange(0, BK)
    o_t = bos + i_t * BT + o_i
    m_t = o_t < eos
    m_k = o_k < K
    m_tk = m_t[:, None] & m_k[None, :]
    p_k = (o_t[:, None] * H + i_h) * K + o_k[None, :]
    b_q = tl.load(q + p_k, mask=m_tk, other=0.0)
    b_k = tl.load(k + p_k, mask=m_tk, other=0.0)
    m_A = (o_i[:, None] >= o_i[None, :]) & m_t[:, None] & m_t[None, :]
    m_At = (o_i[:, None] <= o_i[None, :]) & m_t[:, None] & m_t[None, :]
    b_Pkt = tl.where(m_At, mm(b_k, tl.trans(b_q), RAW_PREC), 0.0) * scale  # [j, i]
    b_dq = tl.zeros([BT, BK], dtype=tl.float32)   # dO Sᵀ
    b_dw = tl.zeros([BT, BK], dtype=tl.float32)   # dX Sᵀ
    b_dPb = tl.zeros([BT, BT], dtype=tl.float32)  # dO Xᵀ
    b_dPk = tl.zeros([BT, BT], dtype=tl.float32)  # dO Vᵀ
    p_state = (i_hc * H + i_h) * K * V + o_k[:, None] * V
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_tv = m_t[:, None] & m_v[None, :]
        p_v = (o_t[:, None] * H + i_h) * V + o_v[None, :]
        b_h = tl.load(h + p_state + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0.0)
        b_dh = tl.load(dh + p_state + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0.0)
        b_x = tl.load(x + p_v, mask=m_tv, other=0.0)
        b_dx = tl.load(dx + p_v, mask=m_tv, other=0.0)
        b_do = tl.load(do + p_v, mask=m_tv, other=0.0)
        b_v = tl.load(v + p_v, mask=m_tv, other=0.0)
        b_dq += mm(b_do, tl.trans(b_h), DOT_PREC)
        b_dw += mm(b_dx, tl.trans(b_h), DOT_PREC)
        b_dPb += mm(b_do, tl.trans(b_x), DOT_PREC)
        b_dPk += mm(b_do, tl.trans(b_v), DOT_PREC)
        b_dv = mm(b_Pkt, b_do, DOT_PREC) + mm(b_k, b_dh, DOT_PREC)
        tl.store(dv + p_v, b_dv, mask=m_tv)
    b_b = tl.load(b + p_k, mask=m_tk, other=0.0)
    b_dq += mm(tl.where(m_A, b_dPb, 0.0), b_b, DOT_PREC)
    b_dq += mm(tl.where(m_A, b_dPk, 0.0), b_k, DOT_PREC)
    tl.store(dq + p_k, cast_for_store(b_dq * scale, dq, DOT_PREC), mask=m_tk)
    tl.store(dw + p_k, cast_for_store(b_dw, dw, DOT_PREC), mask=m_tk)


@triton.jit
def iplr_output_bwd_dkb_kernel(
    q, v, x, dh, do, dk, db, cu_seqlens, chunk_indices, chunk_offsets, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """db = scale (dO Xᵀ ⊙ M)ᵀ Q + X dS'ᵀ,  dk = scale (dO Vᵀ ⊙ M)ᵀ Q + V dS'ᵀ (the WY parts come later)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_n = tl.load(chunk_indices + i_c * 2)
    i_t = tl.load(chunk_indices + i_c * 2 + 1)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    i_hc = tl.load(chunk_offsets + i_n).to(tl.int64) + i_t
    o_i, o_k = tl.arange(0, BT), tl.arange(0, BK)
    o_t = bos + i_t * BT + o_i
    m_t = o_t < eos
    m_k = o_k < K
    m_tk = m_t[:, None] & m_k[None, :]
    b_db = tl.zeros([BT, BK], dtype=tl.float32)   # X dS'ᵀ
    b_dk = tl.zeros([BT, BK], dtype=tl.float32)   # V dS'ᵀ
    b_dPbt = tl.zeros([BT, BT], dtype=tl.float32)  # X dOᵀ
    b_dPkt = tl.zeros([BT, BT], dtype=tl.float32)  # V dOᵀ
    p_state = (i_hc * H + i_h) * K * V + o_k[:, None] * V
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_tv = m_t[:, None] & m_v[None, :]
        p_v = (o_t[:, None] * H + i_h) * V + o_v[None, :]
        b_dh = tl.load(dh + p_state + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0.0)
        b_x = tl.load(x + p_v, mask=m_tv, other=0.0)
        b_do = tl.load(do + p_v, mask=m_tv, other=0.0)
        b_v = tl.load(v + p_v, mask=m_tv, other=0.0)
        b_db += mm(b_x, tl.trans(b_dh), DOT_PREC)
        b_dk += mm(b_v, tl.trans(b_dh), DOT_PREC)
        b_dPbt += mm(b_x, tl.trans(b_do), DOT_PREC)
        b_dPkt += mm(b_v, tl.trans(b_do), DOT_PREC)
    m_At = (o_i[:, None] <= o_i[None, :]) & m_t[:, None] & m_t[None, :]
    p_k = (o_t[:, None] * H + i_h) * K + o_k[None, :]
    b_q = tl.load(q + p_k, mask=m_tk, other=0.0)
    b_db += mm(tl.where(m_At, b_dPbt, 0.0) * scale, b_q, DOT_PREC)
    b_dk += mm(tl.where(m_At, b_dPkt, 0.0) * scale, b_q, DOT_PREC)
    tl.store(dk + p_k, b_dk, mask=m_tk)
    tl.store(db + p_k, b_db, mask=m_tk)


def iplr_output_bwd(q, k, v, b, x, h, dh, do, dx, scale: float, layout: ChunkLayout):
    """→ dq [tokens, H, K] in q's dtype (final), dk, db [tokens, H, K] fp32, dw (in iplr_operand_dtype(q.dtype)) and
    dv [tokens, H, V] fp32 (dk, db, dv still lack the WY part, which iplr_wy_bwd adds)."""
    TT, H, K = q.shape
    V = v.shape[-1]
    if K > 256:
        raise ValueError(f"K={K} > 256 is not supported by the chunked backward")
    dq = torch.empty(TT, H, K, dtype=q.dtype, device=q.device)
    dk, db = (torch.empty(TT, H, K, dtype=torch.float32, device=q.device) for _ in range(2))
    dw = torch.empty_like(dk, dtype=iplr_operand_dtype(q.dtype))  # feeds only the WY backward's dots
    dv = torch.empty(TT, H, V, dtype=torch.float32, device=q.device)
    if layout.num_chunks:
        # Two kernels rather than one: together they keep four [64, K] and four [64, 64] fp32 accumulators live
        # across the V loop (~270 registers/thread at K=128, 8 warps: spills); split, each holds half of them.
        dot_prec = iplr_dot_precision(q.dtype)
        wide = sixteen_bit_dots(dot_prec) and K <= 128
        bv = {kernel: min(bv if wide else 32, triton.next_power_of_2(V)) for kernel, bv in OUTPUT_BWD_BV.items()}
        dqwv_launch = dict(launch("iplr_output_bwd_dqwv"))
        if K > 128:
            dqwv_launch["num_stages"] = min(2, dqwv_launch["num_stages"])
        common = dict(H=H, K=K, V=V, BT=layout.chunk_size, BK=triton.next_power_of_2(K), DOT_PREC=dot_prec)
        iplr_output_bwd_dqwv_kernel[(layout.num_chunks, H)](
            q, k, v, b, x, h, dh, do, dx, dq, dv, dw, layout.cu_seqlens, layout.chunk_indices, layout.chunk_offsets,
            scale, RAW_PREC=raw_precision(q.dtype), BV=bv["dqwv"], **common, **dqwv_launch)
        iplr_output_bwd_dkb_kernel[(layout.num_chunks, H)](
            q, v, x, dh, do, dk, db, layout.cu_seqlens, layout.chunk_indices, layout.chunk_offsets, scale,
            BV=bv["dkb"], **common, **launch("iplr_output_bwd_dkb"))
    return dq, dk, db, dv, dw


@triton.jit
def iplr_wy_bwd_kernel(
    k, v, a, b, Ai, dw, dx, dk, db, dv, da, dk_out, db_out, dv_out, scratch, cu_seqlens, chunk_indices,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DOT_PREC: tl.constexpr, RAW_PREC: tl.constexpr, SCRATCH_T: tl.constexpr,
):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_n = tl.load(chunk_indices + i_c * 2)
    i_t = tl.load(chunk_indices + i_c * 2 + 1)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    o_i = tl.arange(0, BT)
    o_t = bos + i_t * BT + o_i
    m_t = o_t < eos
    m_L = (o_i[:, None] > o_i[None, :]) & m_t[:, None] & m_t[None, :]
    m_U = (o_i[:, None] < o_i[None, :]) & m_t[:, None] & m_t[None, :]
    b_T = tl.load(Ai + (o_t[:, None] * H + i_h) * BT + o_i[None, :], mask=m_t[:, None], other=0.0)
    # Each transposed product below (k_iᵀ a_j, dTᵀ, V dXᵀ and the two T-sandwiches built from them) is either a dot of
    # its own, or with SCRATCH_T the transpose of its partner through a scratch tile (common/scratch.py: a tl.trans
    # of a dot result is what Triton 3.4–3.7.0 miscompiles on Hopper): 10 of the kernel's 36 64×64×64 products fewer.
    b_Mak = tl.zeros([BT, BT], dtype=tl.float32)   # a_iᵀ k_j
    b_Makt = tl.zeros([BT, BT], dtype=tl.float32)  # k_iᵀ a_j
    b_dT = tl.zeros([BT, BT], dtype=tl.float32)
    b_dTt = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = m_t[:, None] & (o_k < K)[None, :]
        p_k = (o_t[:, None] * H + i_h) * K + o_k[None, :]
        b_a = tl.load(a + p_k, mask=m_k, other=0.0)
        b_k = tl.load(k + p_k, mask=m_k, other=0.0)
        b_dw = tl.load(dw + p_k, mask=m_k, other=0.0)
        b_Mak = mma(b_a, tl.trans(b_k), b_Mak, RAW_PREC)
        b_dT = mma(b_dw, tl.trans(b_a), b_dT, DOT_PREC)
        if not SCRATCH_T:
            b_Makt = mma(b_k, tl.trans(b_a), b_Makt, RAW_PREC)
            b_dTt = mma(b_a, tl.trans(b_dw), b_dTt, DOT_PREC)
    b_Mak = tl.where(m_L, b_Mak, 0.0)
    if SCRATCH_T:
        b_Makt = transpose_via_scratch(b_Mak, scratch, i_c, i_h, H, BT, DOT_PREC)
    else:
        b_Makt = tl.where(m_U, b_Makt, 0.0)
    b_dXV = tl.zeros([BT, BT], dtype=tl.float32)  # dX Vᵀ
    b_VdX = tl.zeros([BT, BT], dtype=tl.float32)  # V dXᵀ
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = m_t[:, None] & (o_v < V)[None, :]
        p_v = (o_t[:, None] * H + i_h) * V + o_v[None, :]
        b_v = tl.load(v + p_v, mask=m_v, other=0.0)
        b_dx = tl.load(dx + p_v, mask=m_v, other=0.0)
        b_dXV = mma(b_dx, tl.trans(b_v), b_dXV, DOT_PREC)
        if not SCRATCH_T:
            b_VdX = mma(b_v, tl.trans(b_dx), b_VdX, DOT_PREC)
        b_dY = mm(tl.trans(b_T), b_dx, DOT_PREC)  # ∂L/∂(strict(A Kᵀ) V)
        b_dv = tl.load(dv + p_v, mask=m_v, other=0.0) + mm(b_Makt, b_dY, DOT_PREC)
        tl.store(dv_out + p_v, cast_for_store(b_dv, dv_out, DOT_PREC), mask=m_v)
    b_dT = mma(b_dXV, b_Makt, b_dT, DOT_PREC)
    b_dMab = mm(mm(tl.trans(b_T), b_dT, DOT_PREC), tl.trans(b_T), DOT_PREC)
    b_dMak = mm(tl.trans(b_T), b_dXV, DOT_PREC)
    if SCRATCH_T:  # T dTᵀ T = (Tᵀ dT Tᵀ)ᵀ and V dXᵀ T = (Tᵀ dX Vᵀ)ᵀ
        b_dMabt = tl.where(m_U, transpose_via_scratch(b_dMab, scratch, i_c, i_h, H, BT, DOT_PREC), 0.0)
        b_dMakt = tl.where(m_U, transpose_via_scratch(b_dMak, scratch, i_c, i_h, H, BT, DOT_PREC), 0.0)
    else:
        b_dTt = mma(b_Mak, b_VdX, b_dTt, DOT_PREC)
        b_dMabt = tl.where(m_U, mm(mm(b_T, b_dTt, DOT_PREC), b_T, DOT_PREC), 0.0)
        b_dMakt = tl.where(m_U, mm(b_VdX, b_T, DOT_PREC), 0.0)
    b_dMab = tl.where(m_L, b_dMab, 0.0)
    b_dMak = tl.where(m_L, b_dMak, 0.0)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = m_t[:, None] & (o_k < K)[None, :]
        p_k = (o_t[:, None] * H + i_h) * K + o_k[None, :]
        b_a = tl.load(a + p_k, mask=m_k, other=0.0)
        b_k = tl.load(k + p_k, mask=m_k, other=0.0)
        b_dw = tl.load(dw + p_k, mask=m_k, other=0.0)
        b_b = tl.load(b + p_k, mask=m_k, other=0.0)
        b_da = mm(tl.trans(b_T), b_dw, DOT_PREC) + mm(b_dMak, b_k, DOT_PREC)
        b_da += mm(b_dMab, b_b, DOT_PREC)
        tl.store(da + p_k, cast_for_store(b_da, da, DOT_PREC), mask=m_k)
        b_db = tl.load(db + p_k, mask=m_k, other=0.0) + mm(b_dMabt, b_a, DOT_PREC)
        tl.store(db_out + p_k, cast_for_store(b_db, db_out, DOT_PREC), mask=m_k)
        b_dk = tl.load(dk + p_k, mask=m_k, other=0.0) + mm(b_dMakt, b_a, DOT_PREC)
        tl.store(dk_out + p_k, cast_for_store(b_dk, dk_out, DOT_PREC), mask=m_k)


def iplr_wy_bwd(k, v, a, b, Ai, dw, dx, dk, db, dv, layout: ChunkLayout):
    """The WY backward added to the fp32 partial gradients dk, db [tokens, H, K] and dv [tokens, H, V] → the final
    (dk, db, dv, da), each in its input's dtype (k's, b's, v's, a's), rounded once: written by the kernel, no cast
    pass after it (for fp32 inputs dk, db and dv are updated in place)."""
    TT, H, K = k.shape
    V = v.shape[-1]
    da = torch.empty(TT, H, K, dtype=a.dtype, device=k.device)
    dk_out, db_out, dv_out = (g if g.dtype == x.dtype else torch.empty_like(g, dtype=x.dtype)
                              for g, x in ((dk, k), (db, b), (dv, v)))
    if layout.num_chunks:
        scratch = scratch_tiles(layout, H, iplr_operand_dtype(k.dtype), k.device)
        iplr_wy_bwd_kernel[(layout.num_chunks, H)](
            k, v, a, b, Ai, dw, dx, dk, db, dv, da, dk_out, db_out, dv_out, scratch, layout.cu_seqlens,
            layout.chunk_indices, H=H, K=K, V=V, BT=layout.chunk_size, BK=min(64, triton.next_power_of_2(K)),
            BV=min(64, triton.next_power_of_2(V)), DOT_PREC=iplr_dot_precision(k.dtype),
            RAW_PREC=raw_precision(k.dtype), SCRATCH_T=scratch is not None, **launch("iplr_wy_bwd"))
    return dk_out, db_out, dv_out, da


def chunk_iplr_delta_rule_bwd(q, k, v, a, b, scale: float, initial_state, Ai, do, dht, layout: ChunkLayout):
    """Flattened contiguous inputs (as chunk_iplr_delta_rule_fwd), the saved T matrices Ai, do [tokens, H, V] and
    dht (or None) → (dq, dk, dv, da, db [tokens, H, *] in the inputs' dtypes, dh0 [N, H, K, V] fp32 or None)."""
    _, w, u = iplr_wy_fwd(k, v, a, b, layout, Ai=Ai)
    h, x, _ = iplr_state_pass_fwd(k, v, b, w, u, initial_state, False, layout)
    # The shared reverse state pass: X plays δ, b plays k, and w = −T A keeps its δ = u − w S convention.
    dh, dx, dh0 = state_pass_bwd(q, b, w, None, do, dht, scale, initial_state is not None, layout,
                                 dot_prec=iplr_dot_precision(q.dtype), dh_dtype=iplr_operand_dtype(q.dtype),
                                 dv_dtype=iplr_operand_dtype(q.dtype))
    dq, dk, db, dv, dw = iplr_output_bwd(q, k, v, b, x, h, dh, do, dx, scale, layout)
    dk, db, dv, da = iplr_wy_bwd(k, v, a, b, Ai, dw, dx, dk, db, dv, layout)
    return dq, dk, dv, da, db, dh0
