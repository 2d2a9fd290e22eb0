"""Chunked IPLR delta rule, forward: the solve (T = (I − strict(A Bᵀ))⁻¹ per chunk) → state pass → output pass.

Per chunk (local rows i, j; Q, K, V, A, B the chunk's q, k, v, a, b rows; S the chunk-start state; strict = i > j):
    X = T (A S + strict(A Kᵀ) V)                   (the a-reads x_i = S_{i−1}ᵀ a_i, all at once)
    S ← S + Bᵀ X + Kᵀ V                            (state pass, sequential over chunks)
    O = scale (Q S + (Q Bᵀ ⊙ M) X + (Q Kᵀ ⊙ M) V),   M_ij = [j ≤ i]   (output pass)
The state pass forms X from T and the raw inputs: no WY factors (w = −T A, u = T strict(A Kᵀ) V) go through memory,
so the backward, which reruns this pass for S and X, recomputes nothing but it. Everything runs on the flattened
token axis with a ChunkLayout (common/chunking.py). T, strict(A Kᵀ), the states h and X, which feed nothing but dots,
are stored in those dots' operand dtype (precision.operand_dtype: fp32 unless the IPLR dots run in bf16, when
storing them in bf16 changes no number). The dots' precision dot_prec is the op's `dot` (precision.iplr_dot_precision),
handed to every launch. Products of two raw inputs (a bᵀ, a kᵀ, q kᵀ, q bᵀ, kᵀ v; k qᵀ, k aᵀ in
the backward) take RAW_PREC, the inputs' own dtype on the tensor cores, where they are exact. No dot operand is the
transpose of a dot result (the Hopper miscompile pattern of fla #640, see common/scratch.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.chunking import ChunkLayout, chunk_program, state_program
from ..common.launch import tile
from ..common.precision import cast_for_store, mm, mma, operand_dtype, raw_precision, solve_precision
from ..common.state_pass import state_launch
from ..common.tuning import DEFAULT_TUNING, Tuning
from ..common.wy import solve_unit_lower

# (BK, BV) of the output pass, capped at K's and V's powers of two (Tuning.output_blocks in its place): 0.205 ms at
# 4 warps / 2 stages against 0.210 for 128 × 128 (H100, bf16 B8 T2048 H16 K=V=128, bench_output_blocks.py).
OUTPUT_BLOCKS = (64, 128)
# A varlen batch whose longest sequence is over BALANCED times the mean length loads the forward state pass's raw
# tiles as stored in either launch (Tuning.iplr_raw_in_registers otherwise): its long chains run on alone after the
# others, where prefetched tiles pay (6 sequences of 512–5728 tokens, H16 K=V=128, H100: 0.35 ms against 0.43).
BALANCED = 1.5


@triton.jit
def iplr_solve_kernel(
    k, a, b, Ai, Ak, cu_seqlens, chunk_indices,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    DOT_PREC: tl.constexpr, RAW_PREC: tl.constexpr, SOLVE_PREC: tl.constexpr,
):
    """T = (I − strict(A Bᵀ))⁻¹ and strict(A Kᵀ) per chunk, stored in Ai and Ak."""
    i_h = tl.program_id(1)
    i_c, i_n, i_t, bos, eos, o_i, o_t, m_t = chunk_program(cu_seqlens, chunk_indices, BT)
    m_A = (o_i[:, None] > o_i[None, :]) & m_t[:, None] & m_t[None, :]
    b_Mab = tl.zeros([BT, BT], dtype=tl.float32)  # a_iᵀ b_j
    b_Mak = tl.zeros([BT, BT], dtype=tl.float32)  # a_iᵀ k_j
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = m_t[:, None] & (o_k < K)[None, :]
        p_k = (o_t[:, None] * H + i_h) * K + o_k[None, :]
        b_a = tl.load(a + p_k, mask=m_k, other=0.0)
        b_b = tl.load(b + p_k, mask=m_k, other=0.0)
        b_k = tl.load(k + p_k, mask=m_k, other=0.0)
        b_Mab = mma(b_a, tl.trans(b_b), b_Mab, RAW_PREC)
        b_Mak = mma(b_a, tl.trans(b_k), b_Mak, RAW_PREC)
    p_A = (o_t[:, None] * H + i_h) * BT + o_i[None, :]
    tl.store(Ak + p_A, cast_for_store(tl.where(m_A, b_Mak, 0.0), Ak, DOT_PREC), mask=m_t[:, None])
    b_T = solve_unit_lower(tl.where(m_A, -b_Mab, 0.0), BT, SOLVE_PREC)
    tl.store(Ai + p_A, cast_for_store(b_T, Ai, DOT_PREC), mask=m_t[:, None])


def iplr_solve(k, a, b, layout: ChunkLayout, *, dot_prec: str, tuning: Tuning = DEFAULT_TUNING):
    """k, a, b [tokens, H, K] → (Ai, Ak) [tokens, H, BT]: each chunk's T and strict(A Kᵀ), in
    operand_dtype(a.dtype, dot_prec) (they feed only dots); tuning: the launch choices (common/tuning.py)."""
    TT, H, K = a.shape
    BT = layout.chunk_size
    Ai, Ak = (torch.empty(TT, H, BT, dtype=operand_dtype(a.dtype, dot_prec), device=a.device) for _ in range(2))
    if layout.num_chunks:
        iplr_solve_kernel[(layout.num_chunks, H)](
            k, a, b, Ai, Ak, layout.cu_seqlens, layout.chunk_indices, H=H, K=K, BT=BT,
            BK=tile(K, 64), DOT_PREC=tuning.dot(iplr_solve_kernel, dot_prec),
            RAW_PREC=raw_precision(a.dtype), SOLVE_PREC=solve_precision(a.dtype), **tuning.launch("iplr_solve"))
    return Ai, Ak


@triton.jit
def iplr_state_pass_fwd_kernel(
    k, v, a, b, Ai, Ak, h, x, h0, ht, cu_seqlens, chunk_offsets,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr, DOT_PREC: tl.constexpr, RAW_PREC: tl.constexpr,
    RAW_IN_REGISTERS: tl.constexpr,
):
    i_n, i_h, _, bos, eos, c0, o_i, o_k, o_v, m_k, m_v, m_h, state_offset = state_program(
        cu_seqlens, chunk_offsets, H, H, K, V, BT, BK, BV)  # one value head per head
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_INITIAL_STATE:
        b_h += tl.load(h0 + (i_n * H + i_h).to(tl.int64) * K * V + state_offset, mask=m_h, other=0.0)
    for i_t in range(tl.cdiv(eos - bos, BT)):
        tl.store(h + ((c0 + i_t) * H + i_h) * K * V + state_offset, cast_for_store(b_h, h, DOT_PREC), mask=m_h)
        o_t = bos + i_t * BT + o_i
        m_t = o_t < eos
        m_tk, m_tv = m_t[:, None] & m_k[None, :], m_t[:, None] & m_v[None, :]
        p_k = (o_t[:, None] * H + i_h) * K + o_k[None, :]
        p_v = (o_t[:, None] * H + i_h) * V + o_v[None, :]
        b_a = tl.load(a + p_k, mask=m_tk, other=0.0)
        b_k = tl.load(k + p_k, mask=m_tk, other=0.0)
        b_v = tl.load(v + p_v, mask=m_tv, other=0.0)
        if RAW_IN_REGISTERS:
            b_a, b_k, b_v = b_a.to(tl.float32), b_k.to(tl.float32), b_v.to(tl.float32)
        p_A = (o_t[:, None] * H + i_h) * BT + o_i[None, :]
        b_T = tl.load(Ai + p_A, mask=m_t[:, None], other=0.0)
        # X = T (A S + strict(A Kᵀ) V): strict(A Kᵀ) V is off the chain through S
        b_LV = mm(tl.load(Ak + p_A, mask=m_t[:, None], other=0.0), b_v, DOT_PREC)
        b_x = mm(b_T, mma(b_a, b_h, b_LV, DOT_PREC), DOT_PREC)
        tl.store(x + p_v, cast_for_store(b_x, x, DOT_PREC), mask=m_tv)
        b_b = tl.load(b + p_k, mask=m_tk, other=0.0)
        if RAW_IN_REGISTERS:
            b_b = b_b.to(tl.float32)
        b_h = mma(tl.trans(b_b), b_x, b_h, DOT_PREC)
        b_h = mma(tl.trans(b_k), b_v, b_h, RAW_PREC)
    if STORE_FINAL_STATE:
        tl.store(ht + (i_n * H + i_h).to(tl.int64) * K * V + state_offset, b_h, mask=m_h)


def iplr_state_pass_fwd(k, v, a, b, Ai, Ak, initial_state, output_final_state: bool, layout: ChunkLayout, *,
                        dot_prec: str, tuning: Tuning = DEFAULT_TUNING):
    """→ (h [chunks, H, K, V] chunk-start states, x [tokens, H, V] a-reads, both in operand_dtype(k.dtype,
    dot_prec), final state (fp32) or None)."""
    TT, H, K = k.shape
    V = v.shape[-1]
    N = layout.num_seqs
    # BV (and the K ≤ 256 check) by common/state_pass.py's occupancy rule: 64 value columns per program
    # (iplr_state_pass_fwd_wide) when the programs still fill every SM, else 32.
    name, BK, BV = state_launch("iplr_state_pass_fwd", N * H, K, V, k.device, tuning.sm_count, tuning.value_block)
    h = torch.empty(layout.num_chunks, H, K, V, dtype=operand_dtype(k.dtype, dot_prec), device=k.device)
    x = torch.empty(TT, H, V, dtype=operand_dtype(k.dtype, dot_prec), device=k.device)
    ht = torch.empty(N, H, K, V, dtype=torch.float32, device=k.device) if output_final_state else None
    if initial_state is not None:
        initial_state = initial_state.contiguous()  # addressed as dense [N, H, K, V], whatever the caller's layout
    large_tiles = K > 128 or k.dtype == torch.float32
    balanced = layout.max_len * N <= BALANCED * TT
    launch_kind = "wide" if name.endswith("_wide") else "narrow"
    in_registers = large_tiles or (balanced and tuning.iplr_raw_in_registers[launch_kind])
    if N * H:
        iplr_state_pass_fwd_kernel[(N * H, triton.cdiv(V, BV))](
            k, v, a, b, Ai, Ak, h, x, initial_state, ht, layout.cu_seqlens, layout.chunk_offsets, H=H, K=K, V=V,
            BT=layout.chunk_size, BK=BK, BV=BV, USE_INITIAL_STATE=initial_state is not None,
            STORE_FINAL_STATE=output_final_state, DOT_PREC=tuning.dot(iplr_state_pass_fwd_kernel, dot_prec),
            RAW_PREC=raw_precision(k.dtype), RAW_IN_REGISTERS=in_registers, **tuning.launch(name, large_tiles))
    return h, x, ht


@triton.jit
def iplr_output_fwd_kernel(
    q, k, v, b, x, h, o, cu_seqlens, chunk_indices, chunk_offsets, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DOT_PREC: tl.constexpr, RAW_PREC: tl.constexpr,
):
    i_v, i_h = tl.program_id(1), tl.program_id(2)  # chunks on axis 0 (no 65535 limit)
    i_c, i_n, i_t, bos, eos, o_i, o_t, m_t = chunk_program(cu_seqlens, chunk_indices, BT)
    i_hc = tl.load(chunk_offsets + i_n).to(tl.int64) + i_t  # this chunk's row in h
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    b_o = tl.zeros([BT, BV], dtype=tl.float32)
    b_Pb = tl.zeros([BT, BT], dtype=tl.float32)
    b_Pk = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        p_k = (o_t[:, None] * H + i_h) * K + o_k[None, :]
        m_tk = m_t[:, None] & m_k[None, :]
        # loaded as stored: they feed only dots (common/precision.py mm)
        b_q = tl.load(q + p_k, mask=m_tk, other=0.0)
        b_k = tl.load(k + p_k, mask=m_tk, other=0.0)
        b_b = tl.load(b + p_k, mask=m_tk, other=0.0)
        b_h = tl.load(h + (i_hc * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :],
                      mask=m_k[:, None] & m_v[None, :], other=0.0)
        b_o = mma(b_q, b_h, b_o, DOT_PREC)
        b_Pb = mma(b_q, tl.trans(b_b), b_Pb, RAW_PREC)
        b_Pk = mma(b_q, tl.trans(b_k), b_Pk, RAW_PREC)
    m_A = (o_i[:, None] >= o_i[None, :]) & m_t[:, None] & m_t[None, :]
    p_v = (o_t[:, None] * H + i_h) * V + o_v[None, :]
    m_tv = m_t[:, None] & m_v[None, :]
    b_x = tl.load(x + p_v, mask=m_tv, other=0.0)
    b_v = tl.load(v + p_v, mask=m_tv, other=0.0)
    b_o = mma(tl.where(m_A, b_Pb, 0.0), b_x, b_o, DOT_PREC)
    b_o = mma(tl.where(m_A, b_Pk, 0.0), b_v, b_o, DOT_PREC)
    tl.store(o + p_v, cast_for_store(b_o * scale, o, DOT_PREC), mask=m_tv)


def iplr_output_fwd(q, k, v, b, x, h, scale: float, layout: ChunkLayout, out_dtype, *, dot_prec: str,
                    tuning: Tuning = DEFAULT_TUNING) -> torch.Tensor:
    """The output pass → o [tokens, H, V] in out_dtype, in (BK, BV) tiles (tuning.output_blocks, default
    OUTPUT_BLOCKS) capped at K's and V's powers of two, its dots in dot_prec."""
    blocks = tuning.output_blocks or OUTPUT_BLOCKS
    TT, H, K = q.shape
    V = v.shape[-1]
    o = torch.empty(TT, H, V, dtype=out_dtype, device=q.device)
    BK, BV = tile(K, blocks[0]), tile(V, blocks[1])
    if layout.num_chunks:
        iplr_output_fwd_kernel[(layout.num_chunks, triton.cdiv(V, BV), H)](
            q, k, v, b, x, h, o, layout.cu_seqlens, layout.chunk_indices, layout.chunk_offsets, scale,
            H=H, K=K, V=V, BT=layout.chunk_size, BK=BK, BV=BV, DOT_PREC=tuning.dot(iplr_output_fwd_kernel, dot_prec),
            RAW_PREC=raw_precision(q.dtype), **tuning.launch("iplr_output_fwd"))
    return o


def chunk_iplr_delta_rule_fwd(q, k, v, a, b, scale: float, initial_state, output_final_state: bool,
                              layout: ChunkLayout, *, dot_prec: str, tuning: Tuning = DEFAULT_TUNING):
    """Flattened contiguous inputs q, k, a, b [tokens, H, K], v [tokens, H, V] → (o [tokens, H, V] in v's dtype,
    final state or None, (Ai, Ak): each chunk's T and strict(A Kᵀ), for the backward); dot_prec: every kernel's
    DOT_PREC (precision.iplr_dot_precision); tuning: the launch choices (common/tuning.py)."""
    Ai, Ak = iplr_solve(k, a, b, layout, dot_prec=dot_prec, tuning=tuning)
    h, x, ht = iplr_state_pass_fwd(k, v, a, b, Ai, Ak, initial_state, output_final_state, layout, dot_prec=dot_prec,
                                   tuning=tuning)
    o = iplr_output_fwd(q, k, v, b, x, h, scale, layout, v.dtype, dot_prec=dot_prec, tuning=tuning)
    return o, ht, (Ai, Ak)
