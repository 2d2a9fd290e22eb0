"""A STAND-IN for torch_npu (which only runs on Ascend hardware), for dispatch tests on CPU.

It implements the fused ops rltrain's NPU kernels call — npu_rms_norm, npu_swiglu, npu_rotary_mul and (the single
tensor, grouped-by-size forms the fused MoE uses) npu_grouped_matmul — in plain torch with the documented semantics, and records every call so tests can check what was dispatched with which
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


def npu_grouped_matmul(x, weight, *, group_list=None, split_item=0, group_type=None, group_list_type=0, **unused):
    """One x, one weight, one output (split_item 2/3), group sizes as a tensor (group_list_type 1). group_type 0:
    x [M, K] in row groups, weight [E, K, N] -> [M, N] with rows of group e times weight[e]; group_type 2: x [K, M]
    and weight [M, N] ("weight" is the second operand) in groups along M -> [E, K, N], group e's x[:, rows] @ y[rows]."""
    if len(x) != 1 or len(weight) != 1 or split_item not in (2, 3) or group_list_type != 1:
        raise RuntimeError("npu_grouped_matmul stand-in: only single tensors, split_item 2/3, group_list_type 1")
    (a,), (b,) = x, weight
    sizes = group_list.tolist()
    if sum(sizes) != (a.shape[0] if group_type == 0 else a.shape[1]):
        raise RuntimeError("npu_grouped_matmul: group sizes must add up to the grouped axis")
    calls.append(("npu_grouped_matmul", {"group_type": group_type, "x": tuple(a.shape), "weight": tuple(b.shape)}))
    if group_type == 0:
        return [torch.cat([part @ b[e] for e, part in enumerate(a.split(sizes, dim=0))])]
    if group_type == 2:
        return [torch.stack([xa @ yb for xa, yb in zip(a.split(sizes, dim=1), b.split(sizes, dim=0))])]
    raise RuntimeError(f"npu_grouped_matmul stand-in: group_type {group_type} not implemented")


npu = types.SimpleNamespace(is_available=lambda: True)
