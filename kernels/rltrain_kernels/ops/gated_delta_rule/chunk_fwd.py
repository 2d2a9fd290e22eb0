"""Chunked gated delta rule, forward: gate cumsum → WY (A, T = (I + A)⁻¹, w, u) → state pass → output pass.

Output pass, per (V block, chunk, value head), with S the chunk-start state and δ the corrected values:
    O = scale · (diag(γ) Q S + (Q Kᵀ ⊙ exp(G_i − G_j) [j ≤ i]) δ)
Everything runs on the flattened token axis with a ChunkLayout (common/chunking.py), so padded and packed batches
share one path. Precision of the dots and of the stored h and δ: common/precision.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.chunking import ChunkLayout, chunk_program
from ..common.cumsum import chunk_local_cumsum
from ..common.state_pass import chunk_states_fwd
from ..common.precision import cast_for_store, mma, raw_precision
from ..common.tuning import DEFAULT_TUNING, Tuning
from .gate import gate_chunk_cumsum

# (BK, BV) of the output pass, capped at K's and V's powers of two (Tuning.output_blocks in its place). With BV = V each
# program forms its Q Kᵀ once instead of once per value block: 0.156 ms against 0.177 for 128 × 128 at best (H100,
# bf16 B8 T2048 H16 K=V=128, bench_output_blocks.py).
OUTPUT_BLOCKS = (64, 128)


@triton.jit
def chunk_output_fwd_kernel(
    q, k, v_new, h, G, o, cu_seqlens, chunk_indices, chunk_offsets, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, DOT_PREC: tl.constexpr, RAW_PREC: tl.constexpr,
):
    i_v, i_hv = tl.program_id(1), tl.program_id(2)  # chunks on axis 0 (no 65535 limit)
    i_h = i_hv // (HV // H)
    i_c, i_n, i_t, bos, eos, o_i, o_t, m_t = chunk_program(cu_seqlens, chunk_indices, BT)
    i_hc = tl.load(chunk_offsets + i_n).to(tl.int64) + i_t  # this chunk's row in h
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    b_o = tl.zeros([BT, BV], dtype=tl.float32)
    b_A = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        # q, k, h and δ feed only dots: loaded as stored, they reach the tensor cores from shared memory (mm)
        b_q = tl.load(q + (o_t[:, None] * H + i_h) * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
        b_k = tl.load(k + (o_t[:, None] * H + i_h) * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
        b_h = tl.load(h + (i_hc * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :],
                      mask=m_k[:, None] & m_v[None, :], other=0.0)
        b_o = mma(b_q, b_h, b_o, DOT_PREC)
        b_A = mma(b_q, tl.trans(b_k), b_A, RAW_PREC)
    m_A = (o_i[:, None] >= o_i[None, :]) & m_t[:, None] & m_t[None, :]
    b_G = tl.load(G + o_t * HV + i_hv, mask=m_t, other=0.0)
    b_o = b_o * tl.exp(b_G)[:, None]
    b_A = tl.where(m_A, b_A * tl.exp(tl.where(m_A, b_G[:, None] - b_G[None, :], 0.0)), 0.0)
    p_v = (o_t[:, None] * HV + i_hv) * V + o_v[None, :]
    b_v = tl.load(v_new + p_v, mask=m_t[:, None] & m_v[None, :], other=0.0)
    b_o = mma(b_A, b_v, b_o, DOT_PREC) * scale
    tl.store(o + p_v, cast_for_store(b_o, o, DOT_PREC), mask=m_t[:, None] & m_v[None, :])


def chunk_output_fwd(q, k, v_new, h, G, scale: float, layout: ChunkLayout, out_dtype, *, dot_prec: str,
                     tuning: Tuning = DEFAULT_TUNING) -> torch.Tensor:
    """The output pass → o [tokens, HV, V] in out_dtype, in (BK, BV) tiles (tuning.output_blocks, default
    OUTPUT_BLOCKS) capped at K's and V's powers of two; dot_prec: its DOT_PREC (the op's `dot`, common/precision.py
    op_dot_precision)."""
    blocks = tuning.output_blocks or OUTPUT_BLOCKS
    TT, H, K = q.shape
    HV, V = v_new.shape[1], v_new.shape[2]
    o = torch.empty(TT, HV, V, dtype=out_dtype, device=q.device)
    BK, BV = min(blocks[0], triton.next_power_of_2(K)), min(blocks[1], triton.next_power_of_2(V))
    if layout.num_chunks:
        chunk_output_fwd_kernel[(layout.num_chunks, triton.cdiv(V, BV), HV)](
            q, k, v_new, h, G, o, layout.cu_seqlens, layout.chunk_indices, layout.chunk_offsets, scale,
            H=H, HV=HV, K=K, V=V, BT=layout.chunk_size, BK=BK, BV=BV,
            DOT_PREC=tuning.dot(chunk_output_fwd_kernel, dot_prec), RAW_PREC=raw_precision(q.dtype),
            **tuning.launch("output_fwd"))
    return o


def chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale: float, initial_state, output_final_state: bool,
                               layout: ChunkLayout, gate=None, *, dot_prec: str, recurrence_prec: str,
                               tuning: Tuning = DEFAULT_TUNING):
    """Flattened inputs q, k [tokens, H, K], v [tokens, HV, V], g, beta [tokens, HV] (contiguous) →
    (o [tokens, HV, V] in v's dtype, final state or None, G fp32 chunk-local gate cumsum, Ai: the T matrices in
    operand_dtype(k.dtype, recurrence_prec)). gate: (A_log, dt_bias or None) when g is the raw a of
    g = −exp(A_log) softplus(a + dt_bias) (gate.py), else None. recurrence_prec: the WY and state-pass kernels'
    DOT_PREC (common/precision.py recurrence_dot_precision); dot_prec: the output pass's (op_dot_precision);
    tuning: the launch choices (common/tuning.py)."""
    G = chunk_local_cumsum(g, layout) if gate is None else gate_chunk_cumsum(g, *gate, layout)
    Ai, h, v_new, ht = chunk_states_fwd(k, v, beta, G, initial_state, output_final_state, layout,
                                        dot_prec=recurrence_prec, tuning=tuning)
    o = chunk_output_fwd(q, k, v_new, h, G, scale, layout, v.dtype, dot_prec=dot_prec, tuning=tuning)
    return o, ht, G, Ai
