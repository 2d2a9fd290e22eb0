"""Plain-PyTorch RMSNorm: the ground truth the Triton kernels are tested against, and the CPU fallback.

It mirrors HF transformers' `LlamaRMSNorm.forward` step for step (upcast to fp32, mean of squares, rsqrt, cast back
to the input dtype, multiply by the weight), with one deliberate difference: the result is cast to x's dtype, so an
fp32 weight on a bf16 activation gives bf16 (HF would promote to fp32). The optional residual add is the pre-norm
block's `hidden_states = residual + hidden_states`, done in x's dtype exactly as the eager model does it.
"""

from __future__ import annotations

import torch


def naive_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                   residual: torch.Tensor | None = None):
    """y = weight * x / sqrt(mean(x**2, -1) + eps); with `residual`, s = x + residual and returns (norm(s), s)."""
    if residual is not None:
        s = x + residual
        return naive_rms_norm(s, weight, eps), s
    input_dtype = x.dtype
    hidden = x.to(torch.float32) if x.dtype != torch.float64 else x  # float64 stays float64 for the reference
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    return (weight * hidden.to(input_dtype)).to(input_dtype)


def naive_gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6):
    """y = weight * x / sqrt(mean(x**2, -1) + eps) * silu(gate), step for step as HF's Qwen3NextRMSNormGated:
    normalise in fp32, cast to x's dtype, multiply by the weight (in the weight/x promoted dtype), multiply by
    silu(gate) computed in fp32, cast to x's dtype. float64 inputs stay float64 throughout (reference use)."""
    input_dtype = x.dtype
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    hidden = x.to(compute)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    hidden = weight * hidden.to(input_dtype)
    hidden = hidden * torch.nn.functional.silu(gate.to(compute))
    return hidden.to(input_dtype)
