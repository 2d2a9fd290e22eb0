"""Plain-PyTorch L2 normalisation over the last dim: the ground truth the Triton kernels are tested against, and the
fallback where they cannot run. fla's convention (`fla.modules.l2norm`): eps inside the square root,

    y = x / sqrt(Σ x² + eps)

computed in fp32 (float64 for float64 inputs), returned in `output_dtype` (default x's dtype).
"""

from __future__ import annotations

import torch


def naive_l2norm(x: torch.Tensor, eps: float = 1e-6, output_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x / sqrt(sum(x², -1) + eps) in fp32 (float64 stays float64), cast to output_dtype or x's dtype."""
    xf = x if x.dtype == torch.float64 else x.float()
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(output_dtype or x.dtype)
