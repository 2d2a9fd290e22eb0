"""Row bookkeeping the row- and token-wise kernels share, so no op imports another's kernel module.

Host: `as_rows` (rmsnorm, l2norm: a [rows, D] view with unit column stride), `channel_rows` (short_conv, token_shift:
x [B, T, C] with its channels contiguous, batch and token strides free) and `sequence_ids` (short_conv, token_shift:
a packed row's per-token sequence index). Kernels (@triton.jit): `row_info` and `row_offset` (short_conv,
token_shift): each flat token's sequence, position and length, and its row's element offset.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def as_rows(t: torch.Tensor, n_cols: int) -> torch.Tensor:
    """A [rows, n_cols] view with unit column stride; copies only when no such view exists (e.g. a transposed
    or fully expanded tensor). Row strides may be anything, including 0 (a gradient expanded over rows)."""
    rows = t.reshape(-1, n_cols)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def channel_rows(t: torch.Tensor) -> torch.Tensor:
    """t itself when its last dim is contiguous (batch and token strides are free), else a contiguous copy."""
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def sequence_ids(cu_seqlens: torch.Tensor, n_rows: int) -> torch.Tensor:
    """int32 [n_rows]: the packed sequence each token belongs to (empty sequences hold none), on the device."""
    tokens = torch.arange(n_rows, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens[1:], tokens, right=True).to(torch.int32)


@triton.jit
def row_info(g, n_rows, T, seq_ids, cu_seqlens, IS_VARLEN: tl.constexpr):
    """For flat token indices g (over B·T): (valid, sequence n, position p in it, its length L, batch row b, token
    index t within that row), with b = n and t = p unless packed (b = 0, t = g)."""
    valid = g < n_rows
    if IS_VARLEN:
        n = tl.load(seq_ids + g, mask=valid, other=0)
        bos = tl.load(cu_seqlens + n, mask=valid, other=0).to(tl.int32)
        L = tl.load(cu_seqlens + n + 1, mask=valid, other=0).to(tl.int32) - bos
        p = g - bos
        b = tl.zeros_like(g)
        t = g
    else:
        n = g // T
        p = g - n * T
        L = tl.zeros_like(g) + T
        b = n
        t = p
    return valid, n, p, L, b, t


@triton.jit
def row_offset(b, t, stride_b, stride_t):
    """Element offset of row (b, t) of a [B, T, ·] tensor with these strides, in 64 bits."""
    return b.to(tl.int64) * stride_b + t.to(tl.int64) * stride_t
