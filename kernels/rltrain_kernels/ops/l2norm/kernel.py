"""Fused L2 normalisation over the last dim as Triton kernels: forward, backward, host functions.

Why a kernel: eager l2norm makes ~5 passes over the tensor (upcast, square, sum, rsqrt-multiply, downcast) and
autograd keeps the fp32 copy for backward; here the forward reads x once and writes y once, and the backward reads
x and dy once and writes dx, recomputing 1/‖x‖ from x (nothing but x is saved).

Maths (r = 1/sqrt(Σx² + eps), x̂ = x·r, y = x̂):   dx = r · (dy − x̂ · Σ(dy·x̂))

Rows of D ≤ 64K values, one tile of BR rows × next_pow2(D) columns per program (several rows per program for
narrow rows such as q/k heads of D = 128). Runs on CPU tensors under TRITON_INTERPRET=1 (how CI tests it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rltrain_kernels.ops.common.precision import store_rounded
from rltrain_kernels.ops.common.rows import as_rows
from rltrain_kernels.utils import triton_interpreted

# Widest row the one-tile-per-row kernels take; wider rows go to the plain-PyTorch path.
MAX_FUSED_COLS = 65536
# Elements per program: 4096 (D = 128: 32 rows, 8 KiB of bf16 in and out per program), at 4 warps (32 values per
# thread); larger rows take one row per program and 8 or 16 warps.
TILE_ELEMENTS = 4096


def launch_config(n_cols: int, tile_elements: int = TILE_ELEMENTS) -> tuple[int, int, int]:
    """(BD, BR, num_warps) for rows of n_cols values, about tile_elements per program."""
    block_d = triton.next_power_of_2(n_cols)
    block_r = max(1, min(64, tile_elements // block_d))
    tile = block_d * block_r
    num_warps = 4 if tile <= 4096 else 8 if tile <= 16384 else 16
    return block_d, block_r, num_warps


@triton.jit
def _l2norm_fwd_kernel(x, stride_x, y, n_rows, n_cols, eps, BR: tl.constexpr, BD: tl.constexpr,
                       INTERPRETED: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BD)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    v = tl.load(x + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(v * v, axis=1) + eps)
    store_rounded(y + rows[:, None] * n_cols + cols[None, :], v * r[:, None], mask, INTERPRETED)


@triton.jit
def _l2norm_bwd_kernel(x, stride_x, dy, stride_dy, dx, n_rows, n_cols, eps, BR: tl.constexpr, BD: tl.constexpr,
                       INTERPRETED: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BD)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    v = tl.load(x + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    g = tl.load(dy + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(v * v, axis=1) + eps)
    x_hat = v * r[:, None]
    d = (g - x_hat * tl.sum(g * x_hat, axis=1)[:, None]) * r[:, None]
    store_rounded(dx + rows[:, None] * n_cols + cols[None, :], d, mask, INTERPRETED)


def l2norm_forward(x: torch.Tensor, eps: float, output_dtype: torch.dtype,
                   tile_elements: int = TILE_ELEMENTS) -> tuple[torch.Tensor, torch.Tensor]:
    """(y shaped like x in output_dtype, the [rows, D] view of x the kernel read, for backward); tile_elements:
    elements per program (tuning sweeps: bench_short_conv.py)."""
    n_cols = x.shape[-1]
    x_rows = as_rows(x, n_cols)
    y = torch.empty(x.shape, dtype=output_dtype, device=x.device)
    n_rows = x_rows.shape[0]
    if n_rows:
        block_d, block_r, num_warps = launch_config(n_cols, tile_elements)
        _l2norm_fwd_kernel[(triton.cdiv(n_rows, block_r),)](x_rows, x_rows.stride(0), y, n_rows, n_cols, eps,
                                                            BR=block_r, BD=block_d, INTERPRETED=triton_interpreted(),
                                                            num_warps=num_warps)
    return y, x_rows


def l2norm_backward(dy: torch.Tensor, x_rows: torch.Tensor, eps: float,
                    tile_elements: int = TILE_ELEMENTS) -> torch.Tensor:
    """dx [rows, D] in x's dtype from the upstream gradient dy (any strides) and the saved rows of x; tile_elements as
    l2norm_forward's."""
    n_rows, n_cols = x_rows.shape
    dy_rows = as_rows(dy, n_cols)
    dx = torch.empty((n_rows, n_cols), dtype=x_rows.dtype, device=x_rows.device)
    if n_rows:
        block_d, block_r, num_warps = launch_config(n_cols, tile_elements)
        _l2norm_bwd_kernel[(triton.cdiv(n_rows, block_r),)](x_rows, x_rows.stride(0), dy_rows, dy_rows.stride(0),
                                                            dx, n_rows, n_cols, eps, BR=block_r, BD=block_d,
                                                            INTERPRETED=triton_interpreted(), num_warps=num_warps)
    return dx
