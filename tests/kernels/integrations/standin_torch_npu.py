"""A STAND-IN for torch_npu (which only runs on Ascend hardware), for dispatch tests on CPU.

It implements the three fused ops rltrain's NPU kernels call — npu_rms_norm, npu_swiglu, npu_rotary_mul — in plain
torch with the documented semantics, and records every call so tests can check what was dispatched with which
arguments. It is not torch_npu and proves nothing about the real ops' numerics.
"""

import types

import torch
import torch.nn.functional as F

calls: list[tuple[str, dict]] = []


def npu_rms_norm(x, gamma, epsilon=1e-6):
    calls.append(("npu_rms_norm", {"shape": tuple(x.shape), "epsilon": epsilon}))
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + epsilon)
    return (gamma * (xf * rstd).to(x.dtype)).to(x.dtype), rstd


def npu_swiglu(x, dim=-1):
    if not x.is_contiguous():
        raise RuntimeError("npu_swiglu: non-contiguous input is not supported")
    calls.append(("npu_swiglu", {"shape": tuple(x.shape), "dim": dim}))
    a, b = x.chunk(2, dim=dim)
    return F.silu(a) * b


def npu_rotary_mul(x, r1, r2, rotary_mode="half"):
    if x.dim() != 4 or r1.dim() != 4 or r2.dim() != 4:
        raise RuntimeError("npu_rotary_mul: expects 4-D input, r1, r2")
    calls.append(("npu_rotary_mul", {"shape": tuple(x.shape), "r1": tuple(r1.shape)}))
    x1, x2 = x.chunk(2, dim=-1)
    return x * r1 + torch.cat((-x2, x1), dim=-1) * r2


npu = types.SimpleNamespace(is_available=lambda: True)
