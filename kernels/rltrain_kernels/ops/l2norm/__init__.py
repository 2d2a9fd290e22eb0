"""Fused L2 normalisation over the last dim (fla's `l2norm` / `l2_norm` / `L2Norm`): public function, autograd
Function, module and the plain-PyTorch reference.

    from rltrain_kernels.ops.l2norm import l2norm
    q = l2norm(q)                              # q [..., D]: q / sqrt(Σ q² + eps), eps = 1e-6 inside the sqrt
    k = l2norm(k, output_dtype=torch.float32)

Any leading shape, fp32 accumulation, output in `output_dtype` (default x's dtype), differentiable in x. Same
signature and defaults as fla's `l2norm(x, eps=1e-6, output_dtype=None)`; fla saves y and 1/‖x‖ for backward,
this saves only x and recomputes 1/‖x‖ (the same bytes read, no rounding of y in the backward). Tensors the
kernels cannot take (CPU outside the Triton interpreter, float64, rows wider than 64K) go to `naive_l2norm`, which
computes the same function.
"""

from rltrain_kernels.ops.l2norm.function import L2Norm, L2NormFunction, l2_norm, l2norm
from rltrain_kernels.ops.l2norm.naive import naive_l2norm

__all__ = ["L2Norm", "L2NormFunction", "l2_norm", "l2norm", "naive_l2norm"]
