"""RMSNorm's public entry: the autograd Functions over kernel.py (plain, residual) and gated_kernel.py (gated), the
public functions (the kernels, or naive.py's forms for what they cannot take) and the modules.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable
import torch.nn as nn

from rltrain_kernels.ops.rmsnorm.kernel import MAX_FUSED_COLS, rms_norm_backward, rms_norm_forward
from rltrain_kernels.ops.rmsnorm.gated_kernel import gated_rms_norm_backward, gated_rms_norm_forward
from rltrain_kernels.ops.rmsnorm.naive import naive_gated_rms_norm, naive_rms_norm
from rltrain_kernels.utils import triton_interpreted

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class RMSNormFunction(torch.autograd.Function):
    """apply(x, weight, eps, residual) -> y, or (y, s) when residual is a tensor."""

    @staticmethod
    def forward(ctx, x, weight, eps, residual):
        weight = weight.contiguous()
        y, normed, rstd, s = rms_norm_forward(x, weight, eps, residual)
        ctx.save_for_backward(normed, weight, rstd)
        ctx.has_residual = residual is not None
        # Unused outputs (e.g. s when only y reaches the loss) arrive as None instead of a materialised zero tensor.
        ctx.set_materialize_grads(False)
        if residual is None:
            return y
        return y, s

    @staticmethod
    @once_differentiable  # the backward kernels are not themselves differentiable
    def backward(ctx, dy, ds=None):
        normed, weight, rstd = ctx.saved_tensors
        if dy is None and ds is None:
            return None, None, None, None
        dx, dw = rms_norm_backward(dy, normed, weight, rstd, ds, compute_dw=ctx.needs_input_grad[1])
        return dx, dw, None, (dx if ctx.has_residual else None)


def _kernel_supported(x: torch.Tensor) -> bool:
    return ((x.is_cuda or triton_interpreted()) and x.dtype in _KERNEL_DTYPES
            and 0 < x.shape[-1] <= MAX_FUSED_COLS)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual: torch.Tensor | None = None):
    """RMSNorm over the last dim (fp32 statistics, output in x's dtype); with `residual`, returns (norm(s), s)
    where s = x + residual."""
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)} != ({x.shape[-1]},)")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"rms_norm: residual {tuple(residual.shape)} {residual.dtype} must match x "
                         f"{tuple(x.shape)} {x.dtype}")
    if not _kernel_supported(x):
        return naive_rms_norm(x, weight, eps, residual)
    return RMSNormFunction.apply(x, weight, eps, residual)


class RMSNorm(nn.Module):
    """Drop-in for HF's LlamaRMSNorm/Qwen2RMSNorm (same attribute names `weight`, `variance_epsilon`), with an
    optional fused residual add: forward(x) -> y, forward(x, residual) -> (y, x + residual)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return rms_norm(x, self.weight, self.variance_epsilon, residual)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class GatedRMSNormFunction(torch.autograd.Function):
    """apply(x, gate, weight, eps) -> y = rms_norm(x) * weight * silu(gate)."""

    @staticmethod
    def forward(ctx, x, gate, weight, eps):
        weight = weight.contiguous()
        y, x_rows, g_rows, rstd = gated_rms_norm_forward(x, gate, weight, eps)
        ctx.save_for_backward(x_rows, g_rows, weight, rstd)
        return y

    @staticmethod
    @once_differentiable  # the backward kernels are not themselves differentiable
    def backward(ctx, dy):
        x_rows, g_rows, weight, rstd = ctx.saved_tensors
        dx, dg, dw = gated_rms_norm_backward(dy, x_rows, g_rows, weight, rstd, compute_dw=ctx.needs_input_grad[2])
        return dx, dg, dw, None


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Gated RMSNorm over the last dim (Qwen3-Next's Qwen3NextRMSNormGated): weight * x / sqrt(mean(x²) + eps) *
    silu(gate), computed in fp32, returned in x's dtype. gate has x's shape (any float dtype)."""
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"gated_rms_norm: weight shape {tuple(weight.shape)} != ({x.shape[-1]},)")
    if gate.shape != x.shape:
        raise ValueError(f"gated_rms_norm: gate shape {tuple(gate.shape)} != x shape {tuple(x.shape)}")
    if not (_kernel_supported(x) and gate.dtype in _KERNEL_DTYPES and gate.device == x.device):
        return naive_gated_rms_norm(x, gate, weight, eps)
    return GatedRMSNormFunction.apply(x, gate, weight, eps)


class GatedRMSNorm(nn.Module):
    """Drop-in for HF's Qwen3NextRMSNormGated (same attribute names `weight`, `variance_epsilon`, `activation`):
    forward(x, gate) -> rms_norm(x) * silu(gate)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps
        self.activation = "silu"

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, gate, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"
