"""RMSNorm with an optional fused residual add: public function, autograd Function and nn.Module.

    from rltrain_kernels.ops.rmsnorm import gated_rms_norm, rms_norm, RMSNorm
    y = rms_norm(x, weight, eps=1e-6)                       # y = weight * x / sqrt(mean(x²) + eps)
    y, s = rms_norm(x, weight, eps, residual=residual)      # s = x + residual; y = rms_norm(s)
    y = gated_rms_norm(x, gate, weight, eps=1e-6)           # y = rms_norm(x) * silu(gate)  (Qwen3-Next)

Statistics are fp32; the output has x's dtype (weight may be fp32 or x's dtype). Everything is differentiable
(x, weight, residual, and through the returned s; x, gate, weight for the gated norm). Tensors the Triton kernels
cannot take (CPU tensors outside the interpreter, float64, rows wider than 64K) go to `naive_rms_norm` /
`naive_gated_rms_norm`, which compute the same functions (the gated one step for step as transformers'
Qwen3NextRMSNormGated). Kernels: kernel.py (plain and residual), gated_kernel.py (gated).
"""

from rltrain_kernels.ops.rmsnorm.function import (
    GatedRMSNorm, GatedRMSNormFunction, RMSNorm, RMSNormFunction, gated_rms_norm, rms_norm,
)
from rltrain_kernels.ops.rmsnorm.naive import naive_gated_rms_norm, naive_rms_norm

__all__ = ["GatedRMSNorm", "GatedRMSNormFunction", "RMSNorm", "RMSNormFunction", "gated_rms_norm",
           "naive_gated_rms_norm", "naive_rms_norm", "rms_norm"]
