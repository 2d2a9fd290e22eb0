"""Fused gated RMSNorm (Qwen3-Next's GatedDeltaNet output norm) as Triton kernels: forward, backward, host functions.

    y = w · x̂ · silu(g),   x̂ = x·rstd,   rstd = 1/sqrt(mean(x²) + eps)

Why a kernel: the eager module (Qwen3NextRMSNormGated) runs ~10 elementwise passes over [tokens·heads, head_v_dim]
and autograd keeps several fp32 intermediates (x upcast, x̂, silu(g)); the fused forward reads x and g once, writes
y once and saves one fp32 rstd per row. The backward reads dy, x and g once and writes dx and dg once.

Maths (s = sigmoid(g), silu(g) = g·s, silu'(g) = s·(1 + g·(1 − s)), n = w·x̂, dn = dy·silu(g)):
    dg = dy · n · silu'(g),   dw = Σ_rows dn·x̂,   dx = rstd · (dn·w − x̂ · mean(dn·w·x̂))
i.e. the plain RMSNorm backward with dy replaced by dn. dw partials stay in fp32 registers of a persistent grid and
the small [programs, H] matrix is reduced afterwards, as in kernel.py (whose launch helpers this file reuses).
All maths is fp32; unlike the eager module x̂·w is not rounded to x's dtype before the gate multiply (one rounding,
at the output). Runs on CPU tensors under TRITON_INTERPRET=1 like kernel.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rltrain_kernels.ops.common.rows import as_rows
from rltrain_kernels.ops.rmsnorm.kernel import (
    BACKWARD_PROGRAMS_PER_SM, INTERPRETER_PROGRAMS, _launch_config, _resident_programs_per_sm,
)


@triton.jit
def _gated_rms_norm_fwd_kernel(
    x_ptr, x_row_stride,
    g_ptr, g_row_stride,
    w_ptr,
    y_ptr, y_row_stride,
    rstd_ptr,
    n_rows, n_cols, eps,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_COLS)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & (cols[None, :] < n_cols)

    x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + rows[:, None] * g_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    silu = g * tl.sigmoid(g)
    y = x * rstd[:, None] * w[None, :] * silu
    tl.store(y_ptr + rows[:, None] * y_row_stride + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)


@triton.jit
def _gated_rms_norm_bwd_kernel(
    dy_ptr, dy_row_stride,
    x_ptr, x_row_stride,
    g_ptr, g_row_stride,
    w_ptr, rstd_ptr,
    dx_ptr, dx_row_stride,
    dg_ptr, dg_row_stride,
    dw_partial_ptr,
    n_rows, n_cols, num_programs,
    COMPUTE_DW: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    pid = tl.program_id(0)
    pid64 = pid.to(tl.int64)
    cols = tl.arange(0, BLOCK_COLS)
    col_mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK_COLS], dtype=tl.float32)
    n_blocks = tl.cdiv(n_rows, BLOCK_ROWS)
    # Persistent loop: program p takes row blocks p, p + P, p + 2P, ... and keeps its dw partial in registers.
    for block in range(pid, n_blocks, num_programs):
        rows = (pid64 + (block - pid)) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)  # 64-bit (see kernel.py)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        dy = tl.load(dy_ptr + rows[:, None] * dy_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + rows[:, None] * g_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
        x_hat = x * rstd[:, None]
        sig = tl.sigmoid(g)
        silu = g * sig
        dg = dy * x_hat * w[None, :] * sig * (1.0 + g * (1.0 - sig))
        tl.store(dg_ptr + rows[:, None] * dg_row_stride + cols[None, :], dg.to(dg_ptr.dtype.element_ty), mask=mask)
        dn = dy * silu
        wdn = dn * w[None, :]
        mean_wdn_xhat = tl.sum(wdn * x_hat, axis=1) / n_cols
        dx = (wdn - x_hat * mean_wdn_xhat[:, None]) * rstd[:, None]
        tl.store(dx_ptr + rows[:, None] * dx_row_stride + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if COMPUTE_DW:
            dw_acc += tl.sum(dn * x_hat, axis=0)
    if COMPUTE_DW:
        tl.store(dw_partial_ptr + pid64 * n_cols + cols, dw_acc, mask=col_mask)


def gated_rms_norm_forward(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float):
    """Returns (y, x_rows, gate_rows, rstd): y like x; x_rows/gate_rows are the [rows, H] views (copies only when
    no unit-column-stride view exists) the backward needs; rstd is fp32 [rows]."""
    n_cols = x.shape[-1]
    x_rows = as_rows(x, n_cols)
    g_rows = as_rows(gate, n_cols)
    n_rows = x_rows.shape[0]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y_rows = y.view(-1, n_cols)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    if n_rows == 0:
        return y, x_rows, g_rows, rstd
    block_cols, block_rows, num_warps = _launch_config(n_cols)
    _gated_rms_norm_fwd_kernel[(triton.cdiv(n_rows, block_rows),)](
        x_rows, x_rows.stride(0),
        g_rows, g_rows.stride(0),
        weight,
        y_rows, y_rows.stride(0),
        rstd,
        n_rows, n_cols, eps,
        BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols,
        num_warps=num_warps,
    )
    return y, x_rows, g_rows, rstd


def gated_rms_norm_backward(dy: torch.Tensor, x_rows: torch.Tensor, g_rows: torch.Tensor, weight: torch.Tensor,
                            rstd: torch.Tensor, compute_dw: bool = True, programs_per_sm: int | None = None):
    """Gradients (dx, dgate, dw) from dy (any strides) and the saved rows; dx has x's dtype, dgate the gate's,
    dw the weight's (None when compute_dw is False). programs_per_sm=None sizes the persistent grid to one wave."""
    n_rows, n_cols = x_rows.shape
    dy_rows = as_rows(dy, n_cols)
    dx = torch.empty(dy.shape, dtype=x_rows.dtype, device=x_rows.device)
    dg = torch.empty(dy.shape, dtype=g_rows.dtype, device=x_rows.device)
    dx_rows, dg_rows = dx.view(-1, n_cols), dg.view(-1, n_cols)
    block_cols, block_rows, num_warps = _launch_config(n_cols)
    n_blocks = triton.cdiv(n_rows, block_rows)
    device = x_rows.device
    dw_partial = torch.empty((1,), dtype=torch.float32, device=device)  # placeholder until the grid is known

    def launch(programs: int, warmup: bool = False):
        kernel = _gated_rms_norm_bwd_kernel.warmup if warmup else _gated_rms_norm_bwd_kernel[(programs,)]
        extra = {"grid": (1,)} if warmup else {}
        return kernel(
            dy_rows, dy_rows.stride(0),
            x_rows, x_rows.stride(0),
            g_rows, g_rows.stride(0),
            weight, rstd,
            dx_rows, dx_rows.stride(0),
            dg_rows, dg_rows.stride(0),
            dw_partial,
            n_rows, n_cols, programs,
            COMPUTE_DW=compute_dw,
            BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols,
            num_warps=num_warps, **extra,
        )

    if device.type == "cuda":
        sm_count = torch.cuda.get_device_properties(device).multi_processor_count
        if programs_per_sm is None:
            key = ("gated", device.index, block_cols, block_rows, num_warps, compute_dw,
                   x_rows.dtype, g_rows.dtype, dy_rows.dtype, weight.dtype)
            programs_per_sm = _resident_programs_per_sm(
                lambda: launch(sm_count * BACKWARD_PROGRAMS_PER_SM, warmup=True), key, device, num_warps)
        programs = max(1, min(n_blocks, sm_count * programs_per_sm))
    else:
        programs = max(1, min(n_blocks, INTERPRETER_PROGRAMS))
    if compute_dw:
        dw_partial = torch.empty((programs, n_cols), dtype=torch.float32, device=device)
    if n_rows > 0:
        launch(programs)
    elif compute_dw:
        dw_partial.zero_()
    dw = dw_partial.sum(dim=0).to(weight.dtype) if compute_dw else None
    return dx, dg, dw
