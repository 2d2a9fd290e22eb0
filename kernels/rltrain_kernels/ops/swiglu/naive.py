"""Plain-PyTorch SwiGLU: the ground truth the Triton kernels are tested against, and the CPU fallback.

HF's LlamaMLP computes `act_fn(gate_proj(x)) * up_proj(x)` with act_fn = SiLU in the activation dtype; this
reference does the same maths in fp32 (float64 stays float64) and casts the product back, which is what the
kernel does and is the more accurate of the two.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def naive_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, computed in fp32 (float64 kept), returned in the inputs' dtype."""
    compute = torch.float64 if gate.dtype == torch.float64 else torch.float32
    return (F.silu(gate.to(compute)) * up.to(compute)).to(gate.dtype)
