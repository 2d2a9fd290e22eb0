"""The Gated DeltaNet gate computed inside the ops (fla's `use_gate_in_kernel`, Qwen3-Next's parameterisation):

    g_t = −exp(A_log) · softplus(a_t + dt_bias)          (per value head; a: [tokens, HV], A_log, dt_bias: [HV])

Forward: one kernel turns the raw a into the chunk-local cumsum G the chunked kernels read, in the launch that
`common/cumsum.py` would otherwise make for a precomputed g (the gate itself is never stored). Backward: one kernel
takes dG, forms dg by the reverse chunk-local cumsum (what `chunk_local_cumsum(reverse=True)` does for a precomputed
g), and applies the gate's derivative on the spot:

    da_t = dg_t · (−exp(A_log)) · sigmoid(a_t + dt_bias),   dA_log = Σ_t dg_t g_t,   ddt_bias = Σ_t da_t

the two sums as per-chunk partials [chunks, HV] (no atomics: bit-reproducible) reduced by one torch sum. So the
gate costs no launch beyond the precomputed-g path's, where a torch composition before the op costs about five
elementwise launches forward and eight backward plus an fp32 [tokens, HV] g (README.md, "fla keywords").

`softplus` (common/cumsum.py, also used by the fused-recurrent kernel's in-kernel gate and KDA's gate) follows torch's
F.softplus.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.chunking import ChunkLayout, chunk_program
from ..common.cumsum import softplus


@triton.jit
def gate_chunk_cumsum_kernel(a, A_log, dt_bias, G, cu_seqlens, chunk_indices, NH: tl.constexpr, BT: tl.constexpr,
                             BH: tl.constexpr, HAS_BIAS: tl.constexpr):
    i_c, i_n, i_t, bos, eos, o_i, o_t, m_t = chunk_program(cu_seqlens, chunk_indices, BT)
    o_h = tl.arange(0, BH)
    m_h = o_h < NH
    mask = m_t[:, None] & m_h[None, :]
    offsets = o_t[:, None] * NH + o_h[None, :]
    b_x = tl.load(a + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        b_x += tl.load(dt_bias + o_h, mask=m_h, other=0.0).to(tl.float32)[None, :]
    b_neg_A = -tl.exp(tl.load(A_log + o_h, mask=m_h, other=0.0).to(tl.float32))
    b_g = tl.where(mask, b_neg_A[None, :] * softplus(b_x), 0.0)
    tl.store(G + offsets, tl.cumsum(b_g, axis=0), mask=mask)


@triton.jit
def gate_bwd_kernel(dG, a, A_log, dt_bias, da, dA_part, dbias_part, cu_seqlens, chunk_indices, NH: tl.constexpr,
                    BT: tl.constexpr, BH: tl.constexpr, HAS_BIAS: tl.constexpr):
    i_c, i_n, i_t, bos, eos, o_i, o_t, m_t = chunk_program(cu_seqlens, chunk_indices, BT)
    o_h = tl.arange(0, BH)
    m_h = o_h < NH
    mask = m_t[:, None] & m_h[None, :]
    offsets = o_t[:, None] * NH + o_h[None, :]
    b_dG = tl.load(dG + offsets, mask=mask, other=0.0)
    b_dg = tl.sum(b_dG, axis=0)[None, :] - tl.cumsum(b_dG, axis=0) + b_dG  # dg_i = Σ_{j≥i} dG_j in the chunk
    b_x = tl.load(a + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        b_x += tl.load(dt_bias + o_h, mask=m_h, other=0.0).to(tl.float32)[None, :]
    b_neg_A = -tl.exp(tl.load(A_log + o_h, mask=m_h, other=0.0).to(tl.float32))[None, :]
    b_da = tl.where(mask, b_dg * b_neg_A * tl.sigmoid(b_x), 0.0)
    b_dgg = tl.where(mask, b_dg * b_neg_A * softplus(b_x), 0.0)  # dg_t · g_t = dg_t · ∂g_t/∂A_log
    tl.store(da + offsets, b_da, mask=mask)
    tl.store(dA_part + i_c * NH + o_h, tl.sum(b_dgg, axis=0), mask=m_h)
    if HAS_BIAS:
        tl.store(dbias_part + i_c * NH + o_h, tl.sum(b_da, axis=0), mask=m_h)


def _heads(NH: int) -> int:
    return max(16, triton.next_power_of_2(NH))  # ≥ 16: no degenerate 1-wide tiles (as common/cumsum.py)


def gate_chunk_cumsum(a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None,
                      layout: ChunkLayout) -> torch.Tensor:
    """a: [tokens, HV] raw gate input (any float dtype); A_log, dt_bias (or None): HV elements → G [tokens, HV] fp32,
    the chunk-local cumsum of g = −exp(A_log) softplus(a + dt_bias)."""
    a = a.contiguous()
    G = torch.empty(a.shape, dtype=torch.float32, device=a.device)
    if layout.num_chunks:
        NH = a.shape[1]
        gate_chunk_cumsum_kernel[(layout.num_chunks,)](
            a, A_log.contiguous(), None if dt_bias is None else dt_bias.contiguous(), G, layout.cu_seqlens,
            layout.chunk_indices, NH=NH, BT=layout.chunk_size, BH=_heads(NH), HAS_BIAS=dt_bias is not None)
    return G


def gate_bwd(dG: torch.Tensor, a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None,
             layout: ChunkLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """dG [tokens, HV] (fp32, the gradient of G) → (da [tokens, HV] fp32, dA_log, ddt_bias or None), the last two
    shaped and typed as A_log and dt_bias."""
    a = a.contiguous()
    NH = a.shape[1]
    da = torch.empty(a.shape, dtype=torch.float32, device=a.device)
    parts = torch.empty(2, layout.num_chunks, NH, dtype=torch.float32, device=a.device)
    if layout.num_chunks:
        gate_bwd_kernel[(layout.num_chunks,)](
            dG.contiguous(), a, A_log.contiguous(), None if dt_bias is None else dt_bias.contiguous(), da,
            parts[0], parts[1], layout.cu_seqlens, layout.chunk_indices, NH=NH, BT=layout.chunk_size,
            BH=_heads(NH), HAS_BIAS=dt_bias is not None)
    dA_log = parts[0].sum(0).view(A_log.shape).to(A_log.dtype)
    ddt_bias = None if dt_bias is None else parts[1].sum(0).view(dt_bias.shape).to(dt_bias.dtype)
    return da, dA_log, ddt_bias
