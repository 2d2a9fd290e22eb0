"""SwiGLU's public entry: the autograd Function over kernel.py, `swiglu` (the kernels, or naive.py's form for what
they cannot take) and the `SwiGLU` module.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable
import torch.nn as nn

from rltrain_kernels.ops.swiglu.kernel import swiglu_backward, swiglu_forward
from rltrain_kernels.ops.swiglu.naive import naive_swiglu
from rltrain_kernels.utils import triton_interpreted

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class SwiGLUFunction(torch.autograd.Function):
    """apply(gate, up) -> silu(gate) * up."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return swiglu_forward(gate, up)

    @staticmethod
    @once_differentiable  # the backward kernels are not themselves differentiable
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        return swiglu_backward(dy, gate, up)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up with fp32 maths, returned in the inputs' dtype."""
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} {gate.dtype} {gate.device} and up {tuple(up.shape)} "
                         f"{up.dtype} {up.device} must match")
    if not ((gate.is_cuda or triton_interpreted()) and gate.dtype in _KERNEL_DTYPES):
        return naive_swiglu(gate, up)
    return SwiGLUFunction.apply(gate, up)


class SwiGLU(nn.Module):
    """The MLP's gated activation as a module: forward(gate, up) = silu(gate) * up."""

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return swiglu(gate, up)
