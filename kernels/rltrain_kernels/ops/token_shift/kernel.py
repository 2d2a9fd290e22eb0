"""Token shift as Triton kernels: forward (with the optional cache in and out) and backward, and host functions.

    forward:   out[t] = prev[t] − x[t],   prev[t] = x[t − 1] (same sequence) or cache[n] (t the sequence's first)
    backward:  dx[t] = −dout[t] + dout[t + 1] (same sequence) or d cache_out[n] (t the sequence's last)
               d cache[n] = dout[first token of n] (an empty sequence passes d cache_out[n] on)

Tiles of BT tokens × BD channels over the flattened [B·T] rows, with the row bookkeeping it shares with short_conv
(common/rows.py row_info: sequence, position and length per token, packed rows through a per-token sequence index), so
a tile may straddle sequences. One read of x and one write of out (the shifted load hits L1); runs on CPU tensors under
TRITON_INTERPRET=1 (how CI tests it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rltrain_kernels.ops.common.precision import store_rounded
from rltrain_kernels.ops.common.rows import row_info, row_offset
from rltrain_kernels.utils import triton_interpreted

# Tile (BT tokens, BD channels, warps): 4096 values per program, 32 per thread at 4 warps.
TILE = (32, 128, 4)


@triton.jit
def _token_shift_fwd_kernel(
    x, stride_xb, stride_xt,
    cache, cache_out,
    seq_ids, cu_seqlens,
    y,
    n_rows, T, D,
    HAS_CACHE: tl.constexpr,
    OUTPUT_CACHE: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    INTERPRETED: tl.constexpr,
    BT: tl.constexpr,
    BD: tl.constexpr,
):
    i_d, i_t = tl.program_id(0), tl.program_id(1)
    cols = i_d * BD + tl.arange(0, BD)
    col_mask = cols < D
    g = i_t * BT + tl.arange(0, BT)
    valid, n, p, L, b, t = row_info(g, n_rows, T, seq_ids, cu_seqlens, IS_VARLEN)
    x_off = row_offset(b, t, stride_xb, stride_xt)
    mask = valid[:, None] & col_mask[None, :]
    cur = tl.load(x + x_off[:, None] + cols[None, :], mask=mask, other=0.0)
    prev = tl.load(x + (x_off - stride_xt)[:, None] + cols[None, :], mask=(valid & (p > 0))[:, None] & col_mask[None, :],
                   other=0.0).to(tl.float32)
    cache_rows = n.to(tl.int64)[:, None] * D + cols[None, :]
    if HAS_CACHE:  # in x's dtype, as the reference takes it (exact unless the cache is wider)
        prev += tl.load(cache + cache_rows, mask=(valid & (p == 0))[:, None] & col_mask[None, :],
                        other=0.0).to(x.dtype.element_ty).to(tl.float32)
    # the exact difference of two values of x's dtype, rounded once: as the reference's subtraction in that dtype
    store_rounded(y + g.to(tl.int64)[:, None] * D + cols[None, :], prev - cur.to(tl.float32), mask, INTERPRETED)
    if OUTPUT_CACHE:
        tl.store(cache_out + cache_rows, cur.to(cache_out.dtype.element_ty),
                 mask=(valid & (p == L - 1))[:, None] & col_mask[None, :])


@triton.jit
def _token_shift_bwd_kernel(
    dy, stride_dyb, stride_dyt,
    dcache_out, dcache,
    seq_ids, cu_seqlens,
    dx,
    n_rows, T, D,
    HAS_DCACHE_OUT: tl.constexpr,
    COMPUTE_DCACHE: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    INTERPRETED: tl.constexpr,
    BT: tl.constexpr,
    BD: tl.constexpr,
):
    i_d, i_t = tl.program_id(0), tl.program_id(1)
    cols = i_d * BD + tl.arange(0, BD)
    col_mask = cols < D
    g = i_t * BT + tl.arange(0, BT)
    valid, n, p, L, b, t = row_info(g, n_rows, T, seq_ids, cu_seqlens, IS_VARLEN)
    dy_off = row_offset(b, t, stride_dyb, stride_dyt)
    mask = valid[:, None] & col_mask[None, :]
    cur = tl.load(dy + dy_off[:, None] + cols[None, :], mask=mask, other=0.0)
    nxt = tl.load(dy + (dy_off + stride_dyt)[:, None] + cols[None, :],
                  mask=(valid & (p + 1 < L))[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
    cache_rows = n.to(tl.int64)[:, None] * D + cols[None, :]
    if HAS_DCACHE_OUT:
        nxt += tl.load(dcache_out + cache_rows, mask=(valid & (p == L - 1))[:, None] & col_mask[None, :],
                       other=0.0).to(tl.float32)
    store_rounded(dx + g.to(tl.int64)[:, None] * D + cols[None, :], nxt - cur.to(tl.float32), mask, INTERPRETED)
    if COMPUTE_DCACHE:
        store_rounded(dcache + cache_rows, cur.to(tl.float32), (valid & (p == 0))[:, None] & col_mask[None, :],
                       INTERPRETED)


def _launch(kernel, n_rows: int, D: int, tile, *args, **constexprs) -> None:
    block_t, block_d, num_warps = tile or TILE
    block_d = min(block_d, triton.next_power_of_2(D))
    if n_rows:
        kernel[(triton.cdiv(D, block_d), triton.cdiv(n_rows, block_t))](
            *args, INTERPRETED=triton_interpreted(), BT=block_t, BD=block_d, num_warps=num_warps, **constexprs)


def token_shift_forward(x: torch.Tensor, cu_seqlens: torch.Tensor | None, seq_ids: torch.Tensor | None,
                        cache: torch.Tensor | None, output_cache: bool, num_sequences: int,
                        tile: tuple[int, int, int] | None = None):
    """(out [B, T, D] contiguous, the cache [N, D] or None). x has unit channel stride; cache [N, D] contiguous."""
    B, T, D = x.shape
    y = torch.empty((B, T, D), dtype=x.dtype, device=x.device)
    cache_out = None
    if output_cache:  # what no token overwrites: an empty sequence passes its cache on
        cache_out = cache.to(x.dtype, copy=True) if cache is not None else x.new_zeros(num_sequences, D)
    _launch(_token_shift_fwd_kernel, B * T, D, tile,
            x, x.stride(0), x.stride(1),
            cache if cache is not None else x, cache_out if cache_out is not None else x,
            seq_ids if seq_ids is not None else x, cu_seqlens if cu_seqlens is not None else x,
            y, B * T, T, D,
            HAS_CACHE=cache is not None, OUTPUT_CACHE=output_cache, IS_VARLEN=cu_seqlens is not None)
    return y, cache_out


def token_shift_backward(dy: torch.Tensor, dcache_out: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
                         seq_ids: torch.Tensor | None, compute_dcache: bool, num_sequences: int,
                         cache_dtype: torch.dtype | None, tile: tuple[int, int, int] | None = None):
    """(dx [B, T, D] contiguous in dy's dtype, dcache [N, D] in cache_dtype or None). dy has unit channel stride."""
    B, T, D = dy.shape
    dcache_out = dcache_out.contiguous() if dcache_out is not None else None
    dx = torch.empty((B, T, D), dtype=dy.dtype, device=dy.device)
    dcache = None
    if compute_dcache:  # what no first token overwrites: an empty sequence passes d cache_out on
        dcache = (dcache_out.to(cache_dtype, copy=True) if dcache_out is not None
                  else torch.zeros((num_sequences, D), dtype=cache_dtype, device=dy.device))
    _launch(_token_shift_bwd_kernel, B * T, D, tile,
            dy, dy.stride(0), dy.stride(1),
            dcache_out if dcache_out is not None else dy, dcache if dcache is not None else dy,
            seq_ids if seq_ids is not None else dy, cu_seqlens if cu_seqlens is not None else dy,
            dx, B * T, T, D,
            HAS_DCACHE_OUT=dcache_out is not None, COMPUTE_DCACHE=compute_dcache, IS_VARLEN=cu_seqlens is not None)
    return dx, dcache
