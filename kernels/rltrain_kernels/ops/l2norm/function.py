"""L2 normalisation's public entry: the autograd Function over kernel.py's kernels, `l2norm` (the kernels, or
naive.py's form for what they cannot take), its fla alias `l2_norm` and the `L2Norm` module.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.autograd.function import once_differentiable

from rltrain_kernels.ops.l2norm.kernel import MAX_FUSED_COLS, l2norm_backward, l2norm_forward
from rltrain_kernels.ops.l2norm.naive import naive_l2norm
from rltrain_kernels.utils import triton_interpreted

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class L2NormFunction(torch.autograd.Function):
    """apply(x, eps, output_dtype) -> x / sqrt(Σx² + eps)."""

    @staticmethod
    def forward(ctx, x, eps, output_dtype):
        y, x_rows = l2norm_forward(x, eps, output_dtype)
        ctx.save_for_backward(x_rows)
        ctx.eps, ctx.shape = eps, x.shape
        return y

    @staticmethod
    @once_differentiable  # the backward kernel is not itself differentiable
    def backward(ctx, dy):
        (x_rows,) = ctx.saved_tensors
        return l2norm_backward(dy, x_rows, ctx.eps).view(ctx.shape), None, None


def l2norm(x: torch.Tensor, eps: float = 1e-6, output_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x / sqrt(sum(x², -1) + eps) with fp32 statistics, in output_dtype (default x's dtype)."""
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or not x.is_floating_point():
        raise ValueError(f"l2norm: x must be a float tensor [..., D], got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if output_dtype is not None and not (isinstance(output_dtype, torch.dtype) and output_dtype.is_floating_point):
        raise ValueError(f"l2norm: output_dtype must be a float torch.dtype or None, got {output_dtype!r}")
    if not eps >= 0:
        raise ValueError(f"l2norm: eps must be >= 0, got {eps}")
    output_dtype = output_dtype or x.dtype
    kernel = ((x.is_cuda or triton_interpreted()) and x.dtype in _KERNEL_DTYPES and output_dtype in _KERNEL_DTYPES
              and 0 < x.shape[-1] <= MAX_FUSED_COLS)
    if not kernel:
        return naive_l2norm(x, eps, output_dtype)
    return L2NormFunction.apply(x, float(eps), output_dtype)


l2_norm = l2norm


class L2Norm(nn.Module):
    """fla's L2Norm module: forward(x) = l2norm(x, eps, output_dtype)."""

    def __init__(self, eps: float = 1e-6, output_dtype: torch.dtype | None = None):
        super().__init__()
        self.eps, self.output_dtype = eps, output_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return l2norm(x, self.eps, self.output_dtype)

    def extra_repr(self) -> str:
        return f"eps={self.eps}, output_dtype={self.output_dtype}"
