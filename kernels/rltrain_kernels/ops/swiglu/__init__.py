"""SwiGLU activation, silu(gate) * up: public function, autograd Function and nn.Module.

    from rltrain_kernels.ops.swiglu import swiglu, SwiGLU
    h = swiglu(gate_proj(x), up_proj(x))          # then down_proj(h)

Maths in fp32, output in the inputs' dtype; differentiable w.r.t. gate and up. Tensors the Triton kernels cannot
take (CPU tensors outside the interpreter, float64) go to `naive_swiglu`, which computes the same function.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable
import torch.nn as nn

from rltrain_kernels.ops.swiglu.kernel import swiglu_backward, swiglu_forward
from rltrain_kernels.ops.swiglu.naive import naive_swiglu
from rltrain_kernels.utils import triton_interpreted

__all__ = ["SwiGLU", "SwiGLUFunction", "naive_swiglu", "swiglu"]

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
