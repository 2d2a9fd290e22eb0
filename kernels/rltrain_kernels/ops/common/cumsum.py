"""Chunk-local cumulative sums of per-token log gates, forward (G_i = Σ_{j≤i} g_j within the chunk) and reverse
(the backward of the forward: dg_i = Σ_{j≥i} dG_j within the chunk). Output is fp32 whatever the input dtype.
`softplus`: the in-kernel gates' log(1 + eˣ) (Gated DeltaNet's and KDA's −exp(A_log)·softplus(a + dt_bias)).

One program per chunk covers every head at once: a [chunk, heads] tile, heads contiguous in memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .chunking import ChunkLayout, chunk_program


@triton.jit
def chunk_local_cumsum_kernel(x, y, cu_seqlens, chunk_indices, NH: tl.constexpr, BT: tl.constexpr,
                              BH: tl.constexpr, REVERSE: tl.constexpr):
    i_c, i_n, i_t, bos, eos, o_i, o_t, m_t = chunk_program(cu_seqlens, chunk_indices, BT)
    o_h = tl.arange(0, BH)
    mask = m_t[:, None] & (o_h < NH)[None, :]
    offsets = o_t[:, None] * NH + o_h[None, :]
    b_x = tl.load(x + offsets, mask=mask, other=0.0).to(tl.float32)
    b_y = tl.cumsum(b_x, axis=0)
    if REVERSE:
        b_y = tl.sum(b_x, axis=0)[None, :] - b_y + b_x
    tl.store(y + offsets, b_y, mask=mask)


def chunk_local_cumsum(x: torch.Tensor, layout: ChunkLayout, reverse: bool = False) -> torch.Tensor:
    """x: [total_tokens, heads] (any float dtype) → fp32 chunk-local (reverse) cumulative sum, same shape."""
    x = x.contiguous()
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    if layout.num_chunks == 0:
        return y
    NH = x.shape[1]
    chunk_local_cumsum_kernel[(layout.num_chunks,)](
        x, y, layout.cu_seqlens, layout.chunk_indices, NH=NH, BT=layout.chunk_size,
        BH=max(16, triton.next_power_of_2(NH)), REVERSE=reverse)  # ≥ 16: no degenerate 1-wide tiles
    return y


@triton.jit
def softplus(x):
    """log(1 + eˣ) in fp32: max(x, 0) + log1p(e^{−|x|}), with log1p(y) = log(u)·y/(u − 1), u = 1 + y (exact where
    1 + y rounds, y itself where it rounds to 1); x > 20 gives x, as torch's threshold."""
    y = tl.exp(-tl.abs(x))
    u = 1.0 + y
    log1p = tl.where(u == 1.0, y, tl.log(u) * (y / tl.where(u == 1.0, 1.0, u - 1.0)))
    return tl.where(x > 20.0, x, tl.maximum(x, 0.0) + log1p)
