"""Fused SwiGLU (silu(gate) * up) as Triton kernels: forward, backward and their host functions.

Why a kernel: eager `F.silu(gate) * up` launches two kernels and materialises silu(gate) (one extra write and
read of the [tokens, intermediate] activation, the largest in the MLP), and its backward launches ~6 more. The fused
forward reads gate and up once and writes y once (3 activation-sized transfers); the backward reads gate, up, dy and
writes dgate, dup (5 transfers), recomputing sigmoid(gate) instead of saving it.

Maths (σ = sigmoid(g), fp32): y = g·σ·u,  dup = dy·g·σ,  dgate = dy·u·σ·(1 + g·(1 − σ)).

Layout: tensors are handled as [rows, cols] with unit column stride and any row stride, so gate/up that are the
two halves of a fused gate_up projection (row stride 2·I) are read in place; when every operand is contiguous they
are treated as one long row (no partial blocks at row ends). The same kernels run on CPU tensors under
TRITON_INTERPRET=1, which is how CI tests them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# 4096 elements per program with 8 warps: 16 values per thread = two 16-byte vector loads per operand in bf16,
# enough bytes in flight per SM for an element-wise kernel to run near copy bandwidth on H100-class GPUs.
MAX_BLOCK = 4096


@triton.jit
def _swiglu_fwd_kernel(
    gate_ptr, gate_row_stride,
    up_ptr, up_row_stride,
    y_ptr, y_row_stride,
    n_cols, n_col_blocks,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    row = pid // n_col_blocks
    cols = (pid % n_col_blocks) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(gate_ptr + row * gate_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * up_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(y_ptr + row * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(
    dy_ptr, dy_row_stride,
    gate_ptr, gate_row_stride,
    up_ptr, up_row_stride,
    dgate_ptr, dup_ptr, grad_row_stride,
    n_cols, n_col_blocks,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    row = pid // n_col_blocks
    cols = (pid % n_col_blocks) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dy = tl.load(dy_ptr + row * dy_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + row * gate_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * up_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    dup = dy * silu
    dgate = dy * u * sig * (1.0 + g * (1.0 - sig))
    tl.store(dgate_ptr + row * grad_row_stride + cols, dgate.to(dgate_ptr.dtype.element_ty), mask=mask)
    tl.store(dup_ptr + row * grad_row_stride + cols, dup.to(dup_ptr.dtype.element_ty), mask=mask)


def as_rows_2d(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of same-shaped tensors as [rows, cols] with unit column stride: one long row when all are contiguous,
    else [prod(shape[:-1]), shape[-1]] with per-tensor row strides (copying only a tensor that has no such view)."""
    if all(t.is_contiguous() for t in tensors):
        return [t.view(1, -1) for t in tensors]
    n_cols = tensors[0].shape[-1]
    out = []
    for t in tensors:
        rows = t.reshape(-1, n_cols)
        out.append(rows if rows.stride(-1) == 1 else rows.contiguous())
    return out


def _config(n_cols: int) -> tuple[int, int]:
    block = min(MAX_BLOCK, triton.next_power_of_2(n_cols))
    return block, (4 if block <= 1024 else 8)


def swiglu_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if y.numel() == 0:
        return y
    g2, u2, y2 = as_rows_2d([gate, up, y])
    n_rows, n_cols = g2.shape
    block, num_warps = _config(n_cols)
    n_col_blocks = triton.cdiv(n_cols, block)
    _swiglu_fwd_kernel[(n_rows * n_col_blocks,)](
        g2, g2.stride(0), u2, u2.stride(0), y2, y2.stride(0), n_cols, n_col_blocks,
        BLOCK=block, num_warps=num_warps,
    )
    return y


def swiglu_backward(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup), both contiguous with gate's shape; dy may have any strides (expanded, transposed, ...)."""
    dgate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    dup = torch.empty(up.shape, dtype=up.dtype, device=up.device)
    if dgate.numel() == 0:
        return dgate, dup
    dy2, g2, u2, dg2, du2 = as_rows_2d([dy, gate, up, dgate, dup])
    n_rows, n_cols = g2.shape
    block, num_warps = _config(n_cols)
    n_col_blocks = triton.cdiv(n_cols, block)
    _swiglu_bwd_kernel[(n_rows * n_col_blocks,)](
        dy2, dy2.stride(0), g2, g2.stride(0), u2, u2.stride(0), dg2, du2, dg2.stride(0), n_cols, n_col_blocks,
        BLOCK=block, num_warps=num_warps,
    )
    return dgate, dup
