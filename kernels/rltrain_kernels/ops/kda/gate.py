"""KDA's gate, chunked: the chunk-local cumsum G of the per-channel log decay, from g itself or (fla's
`use_gate_in_kernel`) from the raw a of

    g_t = −exp(A_log) · softplus(a_t + dt_bias)          (a: [tokens, HV, K], A_log: [HV], dt_bias: [HV·K])

Forward: one program per (chunk, value head) turns a [chunk, K] tile of g (or a) into G, fp32 (the gate itself is
never stored). Backward: one program per (chunk, value head) takes dG, forms dg by the reverse chunk-local cumsum and,
with the gate, applies its derivative on the spot:

    da_t = dg_t · (−exp(A_log)) · sigmoid(a_t + dt_bias),   dA_log = Σ_t Σ_k dg_t g_t,   ddt_bias = Σ_t da_t

the two sums as per-(chunk, head) partials reduced by one torch sum (no atomics: bit-reproducible).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.chunking import ChunkLayout, chunk_program
from ..common.cumsum import softplus


@triton.jit
def kda_gate_cumsum_kernel(g, A_log, dt_bias, G, cu_seqlens, chunk_indices, HV: tl.constexpr, K: tl.constexpr,
                           BT: tl.constexpr, BK: tl.constexpr, USE_GATE: tl.constexpr, HAS_BIAS: tl.constexpr):
    i_hv = tl.program_id(1)
    i_c, i_n, i_t, bos, eos, o_i, o_t, m_t = chunk_program(cu_seqlens, chunk_indices, BT)
    o_k = tl.arange(0, BK)
    mask = m_t[:, None] & (o_k < K)[None, :]
    offsets = (o_t[:, None] * HV + i_hv) * K + o_k[None, :]
    b_g = tl.load(g + offsets, mask=mask, other=0.0).to(tl.float32)
    if USE_GATE:
        if HAS_BIAS:
            b_g += tl.load(dt_bias + i_hv * K + o_k, mask=o_k < K, other=0.0).to(tl.float32)[None, :]
        b_g = tl.where(mask, -tl.exp(tl.load(A_log + i_hv).to(tl.float32)) * softplus(b_g), 0.0)
    tl.store(G + offsets, tl.cumsum(b_g, axis=0), mask=mask)


@triton.jit
def kda_gate_bwd_kernel(dG, a, A_log, dt_bias, dg, dA_part, dbias_part, cu_seqlens, chunk_indices,
                        HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                        USE_GATE: tl.constexpr, HAS_BIAS: tl.constexpr):
    i_hv = tl.program_id(1)
    i_c, i_n, i_t, bos, eos, o_i, o_t, m_t = chunk_program(cu_seqlens, chunk_indices, BT)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    mask = m_t[:, None] & m_k[None, :]
    offsets = (o_t[:, None] * HV + i_hv) * K + o_k[None, :]
    b_dG = tl.load(dG + offsets, mask=mask, other=0.0)
    b_dg = tl.sum(b_dG, axis=0)[None, :] - tl.cumsum(b_dG, axis=0) + b_dG  # dg_i = Σ_{j≥i} dG_j in the chunk
    if USE_GATE:
        b_x = tl.load(a + offsets, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            b_x += tl.load(dt_bias + i_hv * K + o_k, mask=m_k, other=0.0).to(tl.float32)[None, :]
        b_neg_A = -tl.exp(tl.load(A_log + i_hv).to(tl.float32))
        b_dgg = tl.where(mask, b_dg * b_neg_A * softplus(b_x), 0.0)  # dg · g = dg · ∂g/∂A_log
        b_dg = tl.where(mask, b_dg * b_neg_A * tl.sigmoid(b_x), 0.0)
        tl.store(dA_part + i_c * HV + i_hv, tl.sum(tl.sum(b_dgg, 1), 0))
        if HAS_BIAS:
            tl.store(dbias_part + (i_c * HV + i_hv) * K + o_k, tl.sum(b_dg, 0), mask=m_k)
    tl.store(dg + offsets, b_dg, mask=mask)


def kda_gate_cumsum(g: torch.Tensor, layout: ChunkLayout, gate=None) -> torch.Tensor:
    """g [tokens, HV, K] (the log decay, or with gate = (A_log, dt_bias or None) the raw a) → G [tokens, HV, K]
    fp32, the chunk-local cumsum of the log decay."""
    g = g.contiguous()
    TT, HV, K = g.shape
    G = torch.empty(g.shape, dtype=torch.float32, device=g.device)
    A_log, dt_bias = gate or (None, None)
    if layout.num_chunks:
        kda_gate_cumsum_kernel[(layout.num_chunks, HV)](
            g, None if A_log is None else A_log.contiguous(), None if dt_bias is None else dt_bias.contiguous(), G,
            layout.cu_seqlens, layout.chunk_indices, HV=HV, K=K, BT=layout.chunk_size,
            BK=max(16, triton.next_power_of_2(K)), USE_GATE=gate is not None, HAS_BIAS=dt_bias is not None)
    return G


def kda_gate_bwd(dG: torch.Tensor, layout: ChunkLayout, a: torch.Tensor | None = None, gate=None):
    """dG [tokens, HV, K] fp32 → (dg fp32: g's gradient, or with gate = (A_log, dt_bias or None) a's; dA_log and
    ddt_bias (None without the gate or the bias) shaped and typed as A_log and dt_bias)."""
    dG = dG.contiguous()
    TT, HV, K = dG.shape
    A_log, dt_bias = gate or (None, None)
    dg = torch.empty(dG.shape, dtype=torch.float32, device=dG.device)
    dA_part = torch.zeros(layout.num_chunks, HV, dtype=torch.float32, device=dG.device)
    dbias_part = torch.zeros(layout.num_chunks, HV, K, dtype=torch.float32, device=dG.device)
    if layout.num_chunks:
        kda_gate_bwd_kernel[(layout.num_chunks, HV)](
            dG, None if a is None else a.contiguous(), None if A_log is None else A_log.contiguous(),
            None if dt_bias is None else dt_bias.contiguous(), dg, dA_part, dbias_part, layout.cu_seqlens,
            layout.chunk_indices, HV=HV, K=K, BT=layout.chunk_size, BK=max(16, triton.next_power_of_2(K)),
            USE_GATE=gate is not None, HAS_BIAS=dt_bias is not None)
    if gate is None:
        return dg, None, None
    dA_log = dA_part.sum(0).view(A_log.shape).to(A_log.dtype)
    ddt_bias = None if dt_bias is None else dbias_part.sum(0).view(dt_bias.shape).to(dt_bias.dtype)
    return dg, dA_log, ddt_bias
