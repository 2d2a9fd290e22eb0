"""The chunked backward shared by the gated delta rule and the gated delta product (on its expanded sub-step axis,
with a query stride): recompute the chunk states S and δ (from the stored T); run the reverse state pass (dS per
chunk, dδ, dh0; it forms wᵀ dδ from T too, common/state_pass.py); the per-chunk pass below (dq, dk, dw, dG); the WY
backward (dk, dv, dβ, dG); and sum dq, dk over each GVA group of value heads. What turns dG into the op's gate
gradient (a reverse chunk-local cumsum, or the in-kernel gate's derivative) is the op's own.

Per chunk, with S the chunk-start state, dS' the gradient of the chunk-end state, P_ij = scale q_iᵀk_j e^{G_i−G_j}
(j ≤ i) and γ = exp(G), γ_L its last entry:
    dP = dO δᵀ (masked),                     dq = scale diag(γ) dO Sᵀ + (dP ⊙ P/qk) K
    dk = (dP ⊙ P/qk)ᵀ Q + diag(e^{G_L−G}) δ dS'ᵀ,   dw = −dδ Sᵀ
    dG_i = scale γ_i q_iᵀ S dO_i + Σ_j (dP⊙P)_ij − Σ_j (dP⊙P)_ji − k_iᵀ dS' δ_i e^{G_L−G_i}
           + [i = L] (γ_L ⟨S, dS'⟩ + Σ_j k_jᵀ dS' δ_j e^{G_L−G_j})
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .chunking import ChunkLayout, chunk_program
from .precision import (
    cast_for_store,
    mm,
    mma,
    operand_dtype,
    raw_precision,
    sixteen_bit_dots,
)
from .scratch import scratch_tiles, transpose_via_scratch
from .state_pass import chunk_states_fwd, query_rows, state_pass_bwd
from .tuning import DEFAULT_TUNING, Tuning
from .wy_bwd import gated_wy_bwd


# Value columns per step of chunk_dqkwg_kernel's loop when its dots take 16-bit operands (bf16 inputs); 32 with fp32
# operands (tf32 / ieee dots: 64 asks for 256 KiB of shared memory, over Hopper's 227). 64 against 32: half the loop
# steps, [64, 64]-wide dots, 0.47 ms against 0.55 (H100, bf16 B8 T2048 H16 K=V=128, --profile).
DQKWG_BV = 64


@triton.jit
def chunk_dqkwg_kernel(
    q, k, v_new, h, dh, do, dv, G, dq, dk, dw, dG, scratch, cu_seqlens, chunk_indices, chunk_offsets, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, DOT_PREC: tl.constexpr, RAW_PREC: tl.constexpr, NH: tl.constexpr,
):
    i_hv = tl.program_id(1)
    i_h = i_hv // (HV // H)
    i_c, i_n, i_t, bos, eos, o_i, o_t, m_t = chunk_program(cu_seqlens, chunk_indices, BT)
    i_hc = tl.load(chunk_offsets + i_n).to(tl.int64) + i_t
    o_k = tl.arange(0, BK)
    o_q, m_q = query_rows(o_t, m_t, NH)  # q, dO and dq: every row, or the query rows of a query stride NH
    m_k = o_k < K
    m_tk = m_t[:, None] & m_k[None, :]
    m_qk = m_q[:, None] & m_k[None, :]
    b_dq = tl.zeros([BT, BK], dtype=tl.float32)   # dO Sᵀ
    b_dk = tl.zeros([BT, BK], dtype=tl.float32)   # δ dS'ᵀ
    b_ndw = tl.zeros([BT, BK], dtype=tl.float32)  # −dw (accumulated with +, so each dot accumulates in place)
    b_dP = tl.zeros([BT, BT], dtype=tl.float32)
    b_hdh = tl.zeros([BK], dtype=tl.float32)
    p_state = (i_hc * HV + i_hv) * K * V + o_k[:, None] * V
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_tv = m_t[:, None] & m_v[None, :]
        p_v = (o_t[:, None] * HV + i_hv) * V + o_v[None, :]
        # loaded as stored: the dots take them (transposed too) from shared memory (common/precision.py mm)
        b_h = tl.load(h + p_state + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0.0)
        b_dh = tl.load(dh + p_state + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0.0)
        b_vn = tl.load(v_new + p_v, mask=m_tv, other=0.0)
        b_dv = tl.load(dv + p_v, mask=m_tv, other=0.0)
        b_do = tl.load(do + (o_q[:, None] * HV + i_hv) * V + o_v[None, :], mask=m_q[:, None] & m_v[None, :],
                       other=0.0)
        b_dq = mma(b_do, tl.trans(b_h), b_dq, DOT_PREC)
        b_dk = mma(b_vn, tl.trans(b_dh), b_dk, DOT_PREC)
        b_ndw = mma(b_dv, tl.trans(b_h), b_ndw, DOT_PREC)
        b_dP = mma(b_do, tl.trans(b_vn), b_dP, DOT_PREC)
        b_hdh += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), 1)
    tl.store(dw + (o_t[:, None] * HV + i_hv) * K + o_k[None, :], cast_for_store(-b_ndw, dw, DOT_PREC), mask=m_tk)
    # q and k as stored for the dots, widened for the row sums
    b_q = tl.load(q + (o_q[:, None] * H + i_h) * K + o_k[None, :], mask=m_qk, other=0.0)
    b_k = tl.load(k + (o_t[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.0)
    b_G = tl.load(G + o_t * HV + i_hv, mask=m_t, other=0.0)
    last = tl.minimum(bos + (i_t + 1) * BT, eos) - 1
    b_G_last = tl.load(G + last * HV + i_hv)
    m_A = (o_i[:, None] >= o_i[None, :]) & m_t[:, None] & m_t[None, :]
    b_E = tl.where(m_A, tl.exp(tl.where(m_A, b_G[:, None] - b_G[None, :], 0.0)), 0.0)
    b_dS = b_dP * b_E * scale  # ∂L/∂(q_iᵀk_j)
    b_dq = b_dq * (tl.exp(b_G) * scale)[:, None]
    b_dG = tl.sum(b_dq * b_q.to(tl.float32), 1)
    b_dq = mma(b_dS, b_k, b_dq, DOT_PREC)
    b_dPP = b_dS * mm(b_q, tl.trans(b_k), RAW_PREC)  # dP ⊙ P
    b_dG += tl.sum(b_dPP, 1) - tl.sum(b_dPP, 0)
    b_dk = b_dk * tl.where(m_t, tl.exp(b_G_last - b_G), 0.0)[:, None]
    b_term = tl.sum(b_dk * b_k.to(tl.float32), 1)
    b_dG -= b_term
    b_dG += tl.where(o_t == last, tl.sum(b_term, 0) + tl.exp(b_G_last) * tl.sum(b_hdh, 0), 0.0)
    # dSᵀ is not tl.trans(b_dS): transposing a tensor-core dot result is miscompiled on Hopper by Triton 3.4–3.7.0
    # (fla #640: wrong dk), so it makes a round trip through a scratch tile (common/scratch.py).
    b_dk = mma(transpose_via_scratch(b_dS, scratch, i_c, i_hv, HV, BT, DOT_PREC), b_q, b_dk, DOT_PREC)
    tl.store(dq + (o_q[:, None] * HV + i_hv) * K + o_k[None, :], cast_for_store(b_dq, dq, DOT_PREC),
             mask=m_qk)
    tl.store(dk + (o_t[:, None] * HV + i_hv) * K + o_k[None, :], b_dk, mask=m_tk)
    tl.store(dG + o_t * HV + i_hv, b_dG, mask=m_t)


def chunk_dqkwg(q, k, v_new, h, dh, do, dv, G, scale: float, layout: ChunkLayout, dq_dtype=torch.float32,
                query_stride: int = 1, *, dot_prec: str, recurrence_prec: str, tuning: Tuning = DEFAULT_TUNING):
    """→ dq (per value head [tokens / query_stride, HV, K] in dq_dtype: the query rows, common/state_pass.py), dk
    (fp32, still lacking the WY part), dw (in operand_dtype(q.dtype, recurrence_prec): it feeds only the WY
    backward's dots, in the recurrence's DOT_PREC), dG (partial, fp32); its own dots in dot_prec; tuning: the launch
    choices."""
    TT, H, K = k.shape
    HV, V = do.shape[1], do.shape[2]
    dq = torch.empty(q.shape[0], HV, K, dtype=dq_dtype, device=q.device)
    dk = torch.empty(TT, HV, K, dtype=torch.float32, device=q.device)
    dw = torch.empty_like(dk, dtype=operand_dtype(q.dtype, recurrence_prec))
    dG = torch.empty(TT, HV, dtype=torch.float32, device=q.device)
    if K > 256:
        raise ValueError(f"K={K} > 256 is not supported by the chunked backward")
    if layout.num_chunks:
        wide = sixteen_bit_dots(dot_prec)  # see DQKWG_BV
        scratch = scratch_tiles(layout, HV, operand_dtype(q.dtype, dot_prec), q.device)
        chunk_dqkwg_kernel[(layout.num_chunks, HV)](
            q, k, v_new, h, dh, do, dv, G, dq, dk, dw, dG, scratch, layout.cu_seqlens, layout.chunk_indices,
            layout.chunk_offsets, scale, H=H, HV=HV, K=K, V=V, BT=layout.chunk_size,
            BK=triton.next_power_of_2(K), BV=min(DQKWG_BV if wide else 32, triton.next_power_of_2(V)),
            DOT_PREC=tuning.dot(chunk_dqkwg_kernel, dot_prec), RAW_PREC=raw_precision(q.dtype), NH=query_stride,
            **tuning.launch("dqkwg"))
    return dq, dk, dw, dG


def gated_chunk_bwd(q, k, v, beta, scale: float, initial_state, G, Ai, do, dht, layout: ChunkLayout,
                    query_stride: int = 1, *, dot_prec: str, recurrence_prec: str, tuning: Tuning = DEFAULT_TUNING):
    """Flattened inputs q, k [tokens, H, K], v [tokens, HV, V], beta [tokens, HV] (contiguous), the forward's G (fp32
    chunk-local gate cumsum) and Ai (T), do and dht (or None) → (dq [tokens, H, K], dk, dv [tokens, HV, V], dG
    [tokens, HV] fp32: the gradient of G, dbeta [tokens, HV], dh0 or None). dv and dbeta come in v's and beta's
    dtype, dq and dk in q's and k's unless value heads share them (GVA: summed in fp32, returned fp32), written so by
    the kernels (no cast afterwards); dh0 fp32. query_stride NH > 1 (the gated delta product): q, do and dq hold
    only the query of every NH-th row, the others being zero (common/state_pass.py). dot_prec, recurrence_prec: the
    forward's DOT_PRECs: the chunk-local kernels', the WY and state-pass kernels'; tuning: the forward's launch
    choices (common/tuning.py)."""
    TT, H, K = k.shape
    HV = v.shape[1]
    gva = HV != H
    _, h, v_new, _ = chunk_states_fwd(k, v, beta, G, initial_state, False, layout, Ai=Ai, dot_prec=recurrence_prec,
                                      tuning=tuning)
    dh, dv_new, dh0 = state_pass_bwd(q, k, G, do, dht, scale, initial_state is not None, layout, Ai, beta=beta,
                                     dot_prec=recurrence_prec, local_prec=dot_prec, query_stride=query_stride,
                                     tuning=tuning)
    dq, dk, dw, dG = chunk_dqkwg(q, k, v_new, h, dh, do, dv_new, G, scale, layout,
                                 dq_dtype=torch.float32 if gva else q.dtype, query_stride=query_stride,
                                 dot_prec=dot_prec, recurrence_prec=recurrence_prec, tuning=tuning)
    dk, dv, dbeta = gated_wy_bwd(k, v, beta, G, Ai, dw, dv_new, dk, dG, layout, dk_final=not gva,
                                 dot_prec=recurrence_prec, tuning=tuning)
    if gva:  # value heads hv = h·(HV/H) + j share q/k head h
        dq = dq.view(dq.shape[0], H, HV // H, K).sum(2)
        dk = dk.view(TT, H, HV // H, K).sum(2)
    return dq, dk, dv, dG, dbeta, dh0
