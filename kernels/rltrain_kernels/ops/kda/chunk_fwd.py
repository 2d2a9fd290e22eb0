"""Chunked KDA, forward: gate cumsum (gate.py) → intra-chunk scores and T (intra.py) → state pass → output pass.

Per chunk, with S the state at its start, G the chunk-local gate cumsum [BT, K], Γ = e^G, L the last row:
    δ = T diag(β) (V − (K ⊙ Γ) S)                               (the corrected values, v_new)
    S ← Diag(Γ_L) S + (K ⊙ e^{G_L − G})ᵀ δ                       (state pass: sequential over chunks)
    O = scale ((Q ⊙ Γ) S + Aqk δ)                                (output pass: parallel over chunks)
Every exponent is ≤ 0, so no factor overflows whatever the decay. Everything runs on the flattened token axis with a
ChunkLayout (common/chunking.py); precision of the dots and of the stored h and δ: common/precision.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.chunking import ChunkLayout, chunk_program, state_program
from ..common.launch import tile
from ..common.precision import cast_for_store, mm, mma, operand_dtype, work_dtype
from ..common.tuning import DEFAULT_TUNING, Tuning
from .gate import kda_gate_cumsum
from .intra import kda_intra_fwd

# Value columns per state-pass and output program (first setting: not yet swept on a GPU).
STATE_BV = 32


@triton.jit
def kda_state_fwd_kernel(
    k, v, beta, G, Ai, h, v_new, h0, ht, cu_seqlens, chunk_offsets,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    i_n, i_hv, i_h, bos, eos, c0, o_i, o_k, o_v, m_k, m_v, m_h, state_offset = state_program(
        cu_seqlens, chunk_offsets, H, HV, K, V, BT, BK, BV)
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_INITIAL_STATE:
        b_h += tl.load(h0 + (i_n * HV + i_hv).to(tl.int64) * K * V + state_offset, mask=m_h, other=0.0)
    for i_t in range(tl.cdiv(eos - bos, BT)):
        tl.store(h + ((c0 + i_t) * HV + i_hv) * K * V + state_offset, cast_for_store(b_h, h, DOT_PREC), mask=m_h)
        o_t = bos + i_t * BT + o_i
        m_t = o_t < eos
        m_tk = m_t[:, None] & m_k[None, :]
        last = tl.minimum(bos + (i_t + 1) * BT, eos) - 1
        b_k = tl.load(k + (o_t[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
        b_G = tl.load(G + (o_t[:, None] * HV + i_hv) * K + o_k[None, :], mask=m_tk, other=0.0)
        b_Gl = tl.load(G + (last * HV + i_hv) * K + o_k, mask=m_k, other=0.0)
        b_T = tl.load(Ai + (o_t[:, None] * HV + i_hv) * BT + o_i[None, :], mask=m_t[:, None], other=0.0)
        b_beta = tl.load(beta + o_t * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
        p_v = (o_t[:, None] * HV + i_hv) * V + o_v[None, :]
        b_v = tl.load(v + p_v, mask=m_t[:, None] & m_v[None, :], other=0.0).to(tl.float32)
        b_d = mm(b_T, (b_v - mm(b_k * tl.exp(b_G), b_h, DOT_PREC)) * b_beta[:, None], DOT_PREC)
        tl.store(v_new + p_v, cast_for_store(b_d, v_new, DOT_PREC), mask=m_t[:, None] & m_v[None, :])
        b_kd = tl.where(m_tk, b_k * tl.exp(b_Gl[None, :] - b_G), 0.0)
        b_h = mma(tl.trans(b_kd), b_d, b_h * tl.exp(b_Gl)[:, None], DOT_PREC)
    if STORE_FINAL_STATE:
        tl.store(ht + (i_n * HV + i_hv).to(tl.int64) * K * V + state_offset, b_h, mask=m_h)


@triton.jit
def kda_output_fwd_kernel(
    q, G, Aqk, v_new, h, o, cu_seqlens, chunk_indices, chunk_offsets, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, DOT_PREC: tl.constexpr,
):
    i_v, i_hv = tl.program_id(1), tl.program_id(2)
    i_h = i_hv // (HV // H)
    i_c, i_n, i_t, bos, eos, o_i, o_t, m_t = chunk_program(cu_seqlens, chunk_indices, BT)
    i_hc = tl.load(chunk_offsets + i_n).to(tl.int64) + i_t
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_tk = m_t[:, None] & m_k[None, :]
    b_q = tl.load(q + (o_t[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
    b_G = tl.load(G + (o_t[:, None] * HV + i_hv) * K + o_k[None, :], mask=m_tk, other=0.0)
    b_h = tl.load(h + (i_hc * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :],
                  mask=m_k[:, None] & m_v[None, :], other=0.0)
    b_A = tl.load(Aqk + (o_t[:, None] * HV + i_hv) * BT + o_i[None, :], mask=m_t[:, None], other=0.0)
    p_v = (o_t[:, None] * HV + i_hv) * V + o_v[None, :]
    b_vn = tl.load(v_new + p_v, mask=m_t[:, None] & m_v[None, :], other=0.0)
    b_o = mma(b_A, b_vn, mm(b_q * tl.exp(b_G), b_h, DOT_PREC), DOT_PREC) * scale
    tl.store(o + p_v, cast_for_store(b_o, o, DOT_PREC), mask=m_t[:, None] & m_v[None, :])


def kda_state_fwd(k, v, beta, G, Ai, initial_state, output_final_state: bool, layout: ChunkLayout, *,
                  dot_prec: str, tuning: Tuning = DEFAULT_TUNING):
    """k [tokens, H, K], v [tokens, HV, V], beta [tokens, HV], G [tokens, HV, K] fp32, the T matrices Ai →
    (h [chunks, HV, K, V] chunk-start states, v_new [tokens, HV, V] = δ (both in work_dtype(k.dtype)), final state
    fp32 or None). dot_prec: the recurrence's DOT_PREC."""
    TT, H, K = k.shape
    HV, V = v.shape[1:]
    N = layout.num_seqs
    BK, BV = tile(K), tile(V, STATE_BV)
    if initial_state is not None:
        initial_state = initial_state.contiguous()  # read as dense [N, HV, K, V] (a state_v_first view: one copy)
    h = torch.empty(layout.num_chunks, HV, K, V, dtype=work_dtype(k.dtype), device=k.device)
    v_new = torch.empty(TT, HV, V, dtype=work_dtype(k.dtype), device=k.device)
    ht = torch.empty(N, HV, K, V, dtype=torch.float32, device=k.device) if output_final_state else None
    if N:  # a sequence without tokens hands its initial state on
        kda_state_fwd_kernel[(N * HV, triton.cdiv(V, BV))](
            k, v, beta, G, Ai, h, v_new, initial_state, ht, layout.cu_seqlens, layout.chunk_offsets, H=H, HV=HV,
            K=K, V=V, BT=layout.chunk_size, BK=BK, BV=BV, USE_INITIAL_STATE=initial_state is not None,
            STORE_FINAL_STATE=output_final_state, DOT_PREC=tuning.dot(kda_state_fwd_kernel, dot_prec),
            **tuning.launch("kda_state_fwd"))
    return h, v_new, ht


def chunk_kda_fwd(q, k, v, g, beta, scale: float, initial_state, output_final_state: bool, layout: ChunkLayout,
                  gate=None, *, dot_prec: str, recurrence_prec: str, tuning: Tuning = DEFAULT_TUNING):
    """Flattened inputs q, k [tokens, H, K], v [tokens, HV, V], g [tokens, HV, K], beta [tokens, HV] (contiguous)
    → (o [tokens, HV, V] in v's dtype, final state or None, G fp32, Ai (T), Aqk). gate: (A_log, dt_bias or None)
    when g is the raw a of g = −exp(A_log) softplus(a + dt_bias) (gate.py), else None. recurrence_prec: the intra
    and state-pass kernels' DOT_PREC; dot_prec: the output pass's (common/precision.py)."""
    G = kda_gate_cumsum(g, layout, gate)
    Ai, Aqk = kda_intra_fwd(q, k, G, beta, layout, aqk_dtype=operand_dtype(q.dtype, dot_prec),
                            dot_prec=recurrence_prec, tuning=tuning)
    h, v_new, ht = kda_state_fwd(k, v, beta, G, Ai, initial_state, output_final_state, layout,
                                 dot_prec=recurrence_prec, tuning=tuning)
    TT, H, K = q.shape
    HV, V = v.shape[1:]
    o = torch.empty(TT, HV, V, dtype=v.dtype, device=v.device)
    BV = tile(V, STATE_BV)
    if layout.num_chunks:
        kda_output_fwd_kernel[(layout.num_chunks, triton.cdiv(V, BV), HV)](
            q, G, Aqk, v_new, h, o, layout.cu_seqlens, layout.chunk_indices, layout.chunk_offsets, scale, H=H,
            HV=HV, K=K, V=V, BT=layout.chunk_size, BK=tile(K), BV=BV,
            DOT_PREC=tuning.dot(kda_output_fwd_kernel, dot_prec), **tuning.launch("kda_output_fwd"))
    return o, ht, G, Ai, Aqk
