"""Chunked KDA, backward: the chunk states recomputed from the stored T (chunk_fwd.py's state pass), the reverse
state pass, the per-chunk state-side gradients, the intra-chunk gradients (intra.py), GVA sums, then dG → dg by the
gate's backward (gate.py: a reverse chunk-local cumsum, and the gate's derivative when the op made g from a raw a).

Per chunk, with S its start state, dS' the gradient of its end state, Q̃ = Q ⊙ Γ, K̃ = K ⊙ Γ, K̂ = K ⊙ e^{G_L − G},
X = V − K̃ S (so δ = T diag(β) X), Y = Tᵀ dδ:
    reverse pass:  dδ = scale Aqkᵀ dO + K̂ dS',    dS = Diag(Γ_L) dS' + scale Q̃ᵀ dO − K̃ᵀ diag(β) Y
    per chunk:     dq = scale (dO Sᵀ) ⊙ Γ,   dv = diag(β) Y,   dβ = Σ_v Y ⊙ X,   dK̃ = −diag(β) Tᵀ (dδ Sᵀ)
                   dk = (δ dS'ᵀ) ⊙ e^{G_L − G} + dK̃ ⊙ Γ,   dT = (dδ Vᵀ − (dδ Sᵀ) K̃ᵀ) diag(β),   dA = −Tᵀ dT Tᵀ
                   dG = dq ⊙ q − (δ dS'ᵀ) ⊙ K̂ + dK̃ ⊙ K̃,  and on row L + Σ_j (δ dS'ᵀ ⊙ K̂)_j + Γ_L ⊙ Σ_v S ⊙ dS'
and the intra-chunk terms from dM_P = scale dO δᵀ (j ≤ i) and dA (j < i): intra.py. Transposed products are dots of
loaded tiles, never tl.trans of a dot result (Triton 3.4–3.7.0 miscompiles that on Hopper: common/precision.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.chunking import ChunkLayout, chunk_program, state_program
from ..common.launch import tile
from ..common.precision import cast_for_store, mm, mma, work_dtype
from ..common.tuning import DEFAULT_TUNING, Tuning
from .chunk_fwd import STATE_BV, kda_gated_keys, kda_state_fwd
from .gate import kda_gate_bwd
from .intra import kda_intra_bwd

# key channels per dqk program: [64, K] fp32 accumulators of the whole key width spilled 3.8 KB a thread at K = 128
DQK_BK = 64


@triton.jit
def kda_state_bwd_kernel(
    qs, kg, kh, G, beta, Ai, Aqk, do, dv, dh, dht, dh0, cu_seqlens, chunk_offsets, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, USE_FINAL_STATE_GRADIENT: tl.constexpr,
    STORE_INITIAL_STATE_GRADIENT: tl.constexpr, DOT_PREC: tl.constexpr,
):
    # H = HV: the gated operands qs = scale Q ⊙ Γ, kg = K̃ and kh = K̂ are per value head (kda_gated_keys)
    i_n, i_hv, i_h, bos, eos, c0, o_i, o_k, o_v, m_k, m_v, m_h, state_offset = state_program(
        cu_seqlens, chunk_offsets, H, HV, K, V, BT, BK, BV)
    b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_FINAL_STATE_GRADIENT:
        b_dh += tl.load(dht + (i_n * HV + i_hv).to(tl.int64) * K * V + state_offset, mask=m_h, other=0.0)
    NT = tl.cdiv(eos - bos, BT)
    for i_r in range(NT):
        i_t = NT - 1 - i_r
        tl.store(dh + ((c0 + i_t) * HV + i_hv) * K * V + state_offset, cast_for_store(b_dh, dh, DOT_PREC),
                 mask=m_h)
        o_t = bos + i_t * BT + o_i
        m_t = o_t < eos
        m_tk = m_t[:, None] & m_k[None, :]
        last = tl.minimum(bos + (i_t + 1) * BT, eos) - 1
        p_g = (o_t[:, None] * HV + i_hv) * K + o_k[None, :]
        b_qs = tl.load(qs + p_g, mask=m_tk, other=0.0)
        b_kg = tl.load(kg + p_g, mask=m_tk, other=0.0)
        b_kh = tl.load(kh + p_g, mask=m_tk, other=0.0)
        b_Gl = tl.load(G + (last * HV + i_hv) * K + o_k, mask=m_k, other=0.0)
        p_A = (o_t[:, None] * HV + i_hv) * BT + o_i[None, :]
        b_T = tl.load(Ai + p_A, mask=m_t[:, None], other=0.0)
        b_A = tl.load(Aqk + p_A, mask=m_t[:, None], other=0.0)
        b_beta = tl.load(beta + o_t * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
        p_v = (o_t[:, None] * HV + i_hv) * V + o_v[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        b_do = tl.load(do + p_v, mask=m_tv, other=0.0)
        b_dd = mma(b_kh, b_dh, mm(tl.trans(b_A), b_do, DOT_PREC) * scale, DOT_PREC)
        tl.store(dv + p_v, cast_for_store(b_dd, dv, DOT_PREC), mask=m_tv)
        b_ny = mm(tl.trans(b_T), -b_dd, DOT_PREC) * b_beta[:, None]  # −diag(β) Tᵀ dδ
        b_dh = mma(tl.trans(b_qs), b_do, b_dh * tl.exp(b_Gl)[:, None], DOT_PREC)
        b_dh = mma(tl.trans(b_kg), b_ny, b_dh, DOT_PREC)
    if STORE_INITIAL_STATE_GRADIENT:
        tl.store(dh0 + (i_n * HV + i_hv).to(tl.int64) * K * V + state_offset, b_dh, mask=m_h)


@triton.jit
def kda_dv_kernel(
    kg, v, beta, Ai, h, v_new, dv_new, do, dv, dbeta, dMP, dA,
    cu_seqlens, chunk_indices, chunk_offsets, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, DOT_PREC: tl.constexpr,
):
    # The value side of a chunk: dv = diag(β) Y, dβ = Σ_v Y ⊙ X, dM_P = scale dO δᵀ and dA = −Tᵀ (dδ Xᵀ diag(β)) Tᵀ,
    # with X = V − K̃ S formed a value block at a time (nothing of the key width is accumulated here)
    i_hv = tl.program_id(1)
    i_c, i_n, i_t, bos, eos, o_i, o_t, m_t = chunk_program(cu_seqlens, chunk_indices, BT)
    i_hc = tl.load(chunk_offsets + i_n).to(tl.int64) + i_t
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    m_tk = m_t[:, None] & m_k[None, :]
    p_A = (o_t[:, None] * HV + i_hv) * BT + o_i[None, :]
    b_T = tl.load(Ai + p_A, mask=m_t[:, None], other=0.0)
    b_beta = tl.load(beta + o_t * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
    b_kg = tl.load(kg + (o_t[:, None] * HV + i_hv) * K + o_k[None, :], mask=m_tk, other=0.0)  # K̃, as stored
    b_dP = tl.zeros([BT, BT], dtype=tl.float32)    # dO δᵀ
    b_dT = tl.zeros([BT, BT], dtype=tl.float32)    # dδ Xᵀ
    b_db = tl.zeros([BT], dtype=tl.float32)        # Σ_v Y ⊙ X
    p_state = (i_hc * HV + i_hv) * K * V + o_k[:, None] * V
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_tv = m_t[:, None] & m_v[None, :]
        p_v = (o_t[:, None] * HV + i_hv) * V + o_v[None, :]
        b_h = tl.load(h + p_state + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0.0)
        b_dd = tl.load(dv_new + p_v, mask=m_tv, other=0.0)
        b_do = tl.load(do + p_v, mask=m_tv, other=0.0)
        b_v = tl.load(v + p_v, mask=m_tv, other=0.0).to(tl.float32)
        b_x = b_v - mm(b_kg, b_h, DOT_PREC)
        b_y = mm(tl.trans(b_T), b_dd, DOT_PREC)  # Y = Tᵀ dδ
        b_db += tl.sum(b_y * b_x, 1)
        tl.store(dv + p_v, cast_for_store(b_y * b_beta[:, None], dv, DOT_PREC), mask=m_tv)
        b_dP = mma(b_do, tl.trans(tl.load(v_new + p_v, mask=m_tv, other=0.0)), b_dP, DOT_PREC)
        # Xᵀ = Vᵀ − Sᵀ K̃ᵀ as its own dot of loaded tiles (never tl.trans of a dot result: common/precision.py)
        b_dT = mma(b_dd, tl.trans(b_v) - mm(tl.trans(b_h), tl.trans(b_kg), DOT_PREC), b_dT, DOT_PREC)
    b_dA = -mm(mm(tl.trans(b_T), b_dT * b_beta[None, :], DOT_PREC), tl.trans(b_T), DOT_PREC)
    m_tt = m_t[:, None] & m_t[None, :]
    tl.store(dA + p_A, tl.where((o_i[:, None] > o_i[None, :]) & m_tt, b_dA, 0.0), mask=m_t[:, None])
    tl.store(dMP + p_A, tl.where((o_i[:, None] >= o_i[None, :]) & m_tt, b_dP * scale, 0.0), mask=m_t[:, None])
    tl.store(dbeta + o_t * HV + i_hv, b_db, mask=m_t)


@triton.jit
def kda_dqk_kernel(
    q, k, G, beta, Ai, h, dh, v_new, dv_new, do, dq, dk, dG,
    cu_seqlens, chunk_indices, chunk_offsets, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, DOT_PREC: tl.constexpr,
):
    # The state side of a chunk's dq, dk, dG, BK key channels a program (every term is per channel):
    # dq = scale (dO Sᵀ) ⊙ Γ, dk = (δ dS'ᵀ) ⊙ e^{G_L − G} + dK̃ ⊙ Γ with dK̃ = −diag(β) Tᵀ (dδ Sᵀ), and dG
    i_hv, i_kb = tl.program_id(1), tl.program_id(2)
    i_h = i_hv // (HV // H)
    i_c, i_n, i_t, bos, eos, o_i, o_t, m_t = chunk_program(cu_seqlens, chunk_indices, BT)
    i_hc = tl.load(chunk_offsets + i_n).to(tl.int64) + i_t
    last = tl.minimum(bos + (i_t + 1) * BT, eos) - 1
    o_k = i_kb * BK + tl.arange(0, BK)
    m_k = o_k < K
    m_tk = m_t[:, None] & m_k[None, :]
    b_dos = tl.zeros([BT, BK], dtype=tl.float32)   # dO Sᵀ
    b_dkh = tl.zeros([BT, BK], dtype=tl.float32)   # δ dS'ᵀ
    b_z = tl.zeros([BT, BK], dtype=tl.float32)     # dδ Sᵀ
    b_hdh = tl.zeros([BK], dtype=tl.float32)       # Σ_v S ⊙ dS'
    p_state = (i_hc * HV + i_hv) * K * V + o_k[:, None] * V
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_tv = m_t[:, None] & m_v[None, :]
        p_v = (o_t[:, None] * HV + i_hv) * V + o_v[None, :]
        b_h = tl.load(h + p_state + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0.0)
        b_dh = tl.load(dh + p_state + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0.0)
        b_dos = mma(tl.load(do + p_v, mask=m_tv, other=0.0), tl.trans(b_h), b_dos, DOT_PREC)
        b_dkh = mma(tl.load(v_new + p_v, mask=m_tv, other=0.0), tl.trans(b_dh), b_dkh, DOT_PREC)
        b_z = mma(tl.load(dv_new + p_v, mask=m_tv, other=0.0), tl.trans(b_h), b_z, DOT_PREC)
        b_hdh += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), 1)
    b_T = tl.load(Ai + (o_t[:, None] * HV + i_hv) * BT + o_i[None, :], mask=m_t[:, None], other=0.0)
    b_beta = tl.load(beta + o_t * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
    b_q = tl.load(q + (o_t[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
    b_k = tl.load(k + (o_t[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
    b_G = tl.load(G + (o_t[:, None] * HV + i_hv) * K + o_k[None, :], mask=m_tk, other=0.0)
    b_Gl = tl.load(G + (last * HV + i_hv) * K + o_k, mask=m_k, other=0.0)
    b_E = tl.exp(b_G)
    b_kg = b_k * b_E                                                      # K̃
    b_kh = tl.where(m_tk, b_k * tl.exp(b_Gl[None, :] - b_G), 0.0)          # K̂
    b_dkt = -mm(tl.trans(b_T), b_z, DOT_PREC) * b_beta[:, None]           # dK̃
    b_dq = b_dos * b_E * scale
    b_dk = b_dkh * tl.exp(tl.where(m_tk, b_Gl[None, :] - b_G, 0.0)) + b_dkt * b_E
    b_dkhk = b_dkh * b_kh
    b_dG = b_dq * b_q - b_dkhk + b_dkt * b_kg
    b_dG += tl.where((o_t == last)[:, None], (tl.sum(b_dkhk, 0) + tl.exp(b_Gl) * b_hdh)[None, :], 0.0)
    p_k = (o_t[:, None] * HV + i_hv) * K + o_k[None, :]
    tl.store(dq + p_k, b_dq, mask=m_tk)
    tl.store(dk + p_k, b_dk, mask=m_tk)
    tl.store(dG + p_k, b_dG, mask=m_tk)


def chunk_kda_bwd(q, k, v, beta, scale: float, initial_state, G, Ai, Aqk, do, dht, layout: ChunkLayout,
                  gate=None, *, dot_prec: str, recurrence_prec: str, tuning: Tuning = DEFAULT_TUNING):
    """Flattened inputs (as chunk_kda_fwd) and the saved G, Ai, Aqk → (dq [tokens, H, K], dk, dv [tokens, HV, V],
    dg [tokens, HV, K], dbeta [tokens, HV], dh0 or None, dA_log, ddt_bias): dv in v's dtype, the others fp32 (dh0,
    dg included). gate: (a, A_log, dt_bias or None) when the forward made g from the raw a: dg is then a's gradient;
    else None, and the last two are None."""
    TT, H, K = k.shape
    HV, V = v.shape[1:]
    N, BT = layout.num_seqs, layout.chunk_size
    kg, kh, qs = kda_gated_keys(q, k, G, layout, scale, dot_prec=recurrence_prec, tuning=tuning)
    h, v_new, _ = kda_state_fwd(kg, kh, v, beta, G, Ai, initial_state, False, layout, dot_prec=recurrence_prec,
                                tuning=tuning)
    BK, BV = tile(K), tile(V, STATE_BV)
    dh = torch.empty(layout.num_chunks, HV, K, V, dtype=work_dtype(k.dtype), device=k.device)
    dv_new = torch.empty(TT, HV, V, dtype=work_dtype(k.dtype), device=k.device)
    dh0 = torch.empty(N, HV, K, V, dtype=torch.float32, device=k.device) if initial_state is not None else None
    if dht is not None:
        dht = dht.contiguous()
    if N:
        kda_state_bwd_kernel[(N * HV, triton.cdiv(V, BV))](
            qs, kg, kh, G, beta, Ai, Aqk, do, dv_new, dh, dht, dh0, layout.cu_seqlens, layout.chunk_offsets, scale,
            H=HV, HV=HV, K=K, V=V, BT=BT, BK=BK, BV=BV, USE_FINAL_STATE_GRADIENT=dht is not None,
            STORE_INITIAL_STATE_GRADIENT=dh0 is not None, DOT_PREC=tuning.dot(kda_state_bwd_kernel, recurrence_prec),
            **tuning.launch("kda_state_bwd"))
    f32 = dict(dtype=torch.float32, device=k.device)
    dq, dk, dG = (torch.empty(TT, HV, K, **f32) for _ in range(3))
    dv = torch.empty(TT, HV, V, dtype=v.dtype, device=v.device)
    dbeta = torch.empty(TT, HV, **f32)
    dMP, dA = torch.empty(TT, HV, BT, **f32), torch.empty(TT, HV, BT, **f32)
    if layout.num_chunks:
        common = dict(H=H, HV=HV, K=K, V=V, BT=BT, BV=BV)
        kda_dv_kernel[(layout.num_chunks, HV)](
            kg, v, beta, Ai, h, v_new, dv_new, do, dv, dbeta, dMP, dA, layout.cu_seqlens, layout.chunk_indices,
            layout.chunk_offsets, scale, BK=BK, **common, DOT_PREC=tuning.dot(kda_dv_kernel, dot_prec),
            **tuning.launch("kda_dv"))
        kda_dqk_kernel[(layout.num_chunks, HV, triton.cdiv(K, DQK_BK))](
            q, k, G, beta, Ai, h, dh, v_new, dv_new, do, dq, dk, dG, layout.cu_seqlens, layout.chunk_indices,
            layout.chunk_offsets, scale, BK=min(BK, DQK_BK), **common, DOT_PREC=tuning.dot(kda_dqk_kernel, dot_prec),
            **tuning.launch("kda_dqk"))
        kda_intra_bwd(q, k, G, beta, dMP, dA, dq, dk, dG, dbeta, layout, dot_prec=dot_prec, tuning=tuning)
    if HV != H:  # value heads hv = h·(HV/H) + j share q/k head h
        dq, dk = dq.view(TT, H, HV // H, K).sum(2), dk.view(TT, H, HV // H, K).sum(2)
    if gate is None:
        dg, dA_log, ddt_bias = kda_gate_bwd(dG, layout)
    else:
        dg, dA_log, ddt_bias = kda_gate_bwd(dG, layout, gate[0], gate[1:])
    return dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias
