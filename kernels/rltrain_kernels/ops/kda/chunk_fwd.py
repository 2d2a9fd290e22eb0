"""Chunked KDA, forward: gate cumsum (gate.py) → intra-chunk scores and T (intra.py) → gated keys → state pass →
output pass.

Per chunk, with S the state at its start, G the chunk-local gate cumsum [BT, K], Γ = e^G, L the last row:
    δ = T diag(β) (V − (K ⊙ Γ) S)                               (the corrected values, v_new)
    S ← Diag(Γ_L) S + (K ⊙ e^{G_L − G})ᵀ δ                       (state pass: sequential over chunks)
    O = scale ((Q ⊙ Γ) S + Aqk δ)                                (output pass: parallel over chunks)
Every exponent is ≤ 0, so no factor overflows whatever the decay. The state passes (this one and chunk_bwd.py's
reverse pass) read the gated keys K̃ = K ⊙ Γ and K̂ = K ⊙ e^{G_L − G} (and scale Q ⊙ Γ) made in parallel first by
kda_gated_keys_kernel, in the dots' operand dtype, so no [BT, K] exponent sits in their sequential loop (the backward
makes them again rather than keep them: two more [tokens, HV, K] tensors per layer). Everything runs on the flattened
token axis with a ChunkLayout (common/chunking.py); precision of the dots and of the stored h and δ:
common/precision.py.
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
# Key channels per kda_gated_keys program
GATED_BK = 64


@triton.jit
def kda_gated_keys_kernel(
    q, k, G, kg, kh, qs, cu_seqlens, chunk_indices, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    STORE_QS: tl.constexpr, DOT_PREC: tl.constexpr,
):
    # A chunk's gated key (and query) tiles for the state passes, made in parallel: K̃ = K ⊙ Γ, K̂ = K ⊙ e^{G_L − G}
    # (0 off the sequence) and scale Q ⊙ Γ, in the dots' operand dtype (rounded as the dots' own casts would)
    i_hv, i_kb = tl.program_id(1), tl.program_id(2)
    i_h = i_hv // (HV // H)
    i_c, i_n, i_t, bos, eos, o_i, o_t, m_t = chunk_program(cu_seqlens, chunk_indices, BT)
    last = tl.minimum(bos + (i_t + 1) * BT, eos) - 1
    o_k = i_kb * BK + tl.arange(0, BK)
    m_k = o_k < K
    m_tk = m_t[:, None] & m_k[None, :]
    b_G = tl.load(G + (o_t[:, None] * HV + i_hv) * K + o_k[None, :], mask=m_tk, other=0.0)
    b_Gl = tl.load(G + (last * HV + i_hv) * K + o_k, mask=m_k, other=0.0)
    b_k = tl.load(k + (o_t[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
    p_g = (o_t[:, None] * HV + i_hv) * K + o_k[None, :]
    b_E = tl.exp(b_G)
    tl.store(kg + p_g, cast_for_store(b_k * b_E, kg, DOT_PREC), mask=m_tk)
    tl.store(kh + p_g, cast_for_store(b_k * tl.exp(tl.where(m_tk, b_Gl[None, :] - b_G, 0.0)), kh, DOT_PREC),
             mask=m_tk)
    if STORE_QS:
        b_q = tl.load(q + (o_t[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
        tl.store(qs + p_g, cast_for_store(b_q * b_E * scale, qs, DOT_PREC), mask=m_tk)


@triton.jit
def kda_state_fwd_kernel(
    kg, kh, v, beta, G, Ai, h, v_new, h0, ht, cu_seqlens, chunk_offsets,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    # H = HV: the gated keys K̃ = kg and K̂ = kh are per value head (kda_gated_keys)
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
        # K̃, K̂ and T feed only dots: loaded as stored (kda_gated_keys_kernel made the gated keys)
        p_g = (o_t[:, None] * HV + i_hv) * K + o_k[None, :]
        b_kg = tl.load(kg + p_g, mask=m_tk, other=0.0)
        b_kh = tl.load(kh + p_g, mask=m_tk, other=0.0)
        b_Gl = tl.load(G + (last * HV + i_hv) * K + o_k, mask=m_k, other=0.0)
        b_T = tl.load(Ai + (o_t[:, None] * HV + i_hv) * BT + o_i[None, :], mask=m_t[:, None], other=0.0)
        b_beta = tl.load(beta + o_t * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
        p_v = (o_t[:, None] * HV + i_hv) * V + o_v[None, :]
        b_v = tl.load(v + p_v, mask=m_t[:, None] & m_v[None, :], other=0.0).to(tl.float32)
        b_d = mm(b_T, (b_v - mm(b_kg, b_h, DOT_PREC)) * b_beta[:, None], DOT_PREC)
        tl.store(v_new + p_v, cast_for_store(b_d, v_new, DOT_PREC), mask=m_t[:, None] & m_v[None, :])
        b_h = mma(tl.trans(b_kh), b_d, b_h * tl.exp(b_Gl)[:, None], DOT_PREC)
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


def kda_gated_keys(q, k, G, layout: ChunkLayout, scale: float | None = None, *, dot_prec: str,
                   tuning: Tuning = DEFAULT_TUNING):
    """k [tokens, H, K], G [tokens, HV, K] fp32 → (K̃, K̂, scale Q ⊙ Γ or None without scale) [tokens, HV, K] in
    operand_dtype(k.dtype, dot_prec): the state passes' gated operands (dot_prec: the recurrence's DOT_PREC)."""
    TT, H, K = k.shape
    HV = G.shape[1]
    BK = tile(K, GATED_BK)
    kg, kh = (torch.empty(TT, HV, K, dtype=operand_dtype(k.dtype, dot_prec), device=k.device) for _ in range(2))
    qs = torch.empty_like(kg) if scale is not None else None
    if layout.num_chunks:
        kda_gated_keys_kernel[(layout.num_chunks, HV, triton.cdiv(K, BK))](
            q, k, G, kg, kh, qs, layout.cu_seqlens, layout.chunk_indices, scale or 1.0, H=H, HV=HV, K=K,
            BT=layout.chunk_size, BK=BK, STORE_QS=scale is not None,
            DOT_PREC=tuning.dot(kda_gated_keys_kernel, dot_prec), **tuning.launch("kda_gated_keys"))
    return kg, kh, qs


def kda_state_fwd(kg, kh, v, beta, G, Ai, initial_state, output_final_state: bool, layout: ChunkLayout, *,
                  dot_prec: str, tuning: Tuning = DEFAULT_TUNING):
    """The gated keys K̃, K̂ [tokens, HV, K] (kda_gated_keys), v [tokens, HV, V], beta [tokens, HV], G [tokens, HV,
    K] fp32, the T matrices Ai → (h [chunks, HV, K, V] chunk-start states, v_new [tokens, HV, V] = δ (both in
    work_dtype(v.dtype)), final state fp32 or None). dot_prec: the recurrence's DOT_PREC."""
    TT, HV, K = kg.shape
    V = v.shape[2]
    N = layout.num_seqs
    BK, BV = tile(K), tile(V, STATE_BV)
    if initial_state is not None:
        initial_state = initial_state.contiguous()  # read as dense [N, HV, K, V] (a state_v_first view: one copy)
    h = torch.empty(layout.num_chunks, HV, K, V, dtype=work_dtype(v.dtype), device=v.device)
    v_new = torch.empty(TT, HV, V, dtype=work_dtype(v.dtype), device=v.device)
    ht = torch.empty(N, HV, K, V, dtype=torch.float32, device=v.device) if output_final_state else None
    if N:  # a sequence without tokens hands its initial state on
        kda_state_fwd_kernel[(N * HV, triton.cdiv(V, BV))](
            kg, kh, v, beta, G, Ai, h, v_new, initial_state, ht, layout.cu_seqlens, layout.chunk_offsets,
            H=HV, HV=HV, K=K, V=V, BT=layout.chunk_size, BK=BK, BV=BV, USE_INITIAL_STATE=initial_state is not None,
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
    kg, kh, _ = kda_gated_keys(q, k, G, layout, dot_prec=recurrence_prec, tuning=tuning)
    h, v_new, ht = kda_state_fwd(kg, kh, v, beta, G, Ai, initial_state, output_final_state, layout,
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
