"""The fused MoE on Ascend NPUs: the routed rows sorted by expert, then torch_npu.npu_grouped_matmul (one grouped GEMM
over every expert's rows) for the gate|up and the down projections, SwiGLU and the weighted sum in torch.

npu_grouped_matmul has no autograd of its own, so `GroupedMatmul` gives it one: y = x @ W[e] over each expert's row
group (group_type 0: groups along M; group_list_type 1: the groups' sizes), dx = dy @ W[e]ᵀ the same way, and
dW[e] = x_eᵀ @ dy_e with the groups along K (group_type 2), as LLaMA-Factory's npu_fused_moe does. The weights are
passed as transposed views of transformers' [E, N, K] stacks (torch_npu takes a transposed weight in place).
A torch_npu without npu_grouped_matmul runs the reference (naive.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rltrain_kernels.ops.fused_moe.naive import naive_fused_moe


class GroupedMatmul(torch.autograd.Function):
    """apply(x [M, K] sorted by group, weight [E, K, N], counts [E] int64 rows per group) -> [M, N]."""

    @staticmethod
    def forward(ctx, x, weight, counts):
        import torch_npu

        ctx.save_for_backward(x, weight, counts)
        return torch_npu.npu_grouped_matmul([x], [weight], group_list=counts, split_item=2, group_type=0,
                                            group_list_type=1)[0]

    @staticmethod
    def backward(ctx, dy):
        import torch_npu

        x, weight, counts = ctx.saved_tensors
        dy = dy.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = torch_npu.npu_grouped_matmul([dy], [weight.transpose(1, 2)], group_list=counts, split_item=2,
                                              group_type=0, group_list_type=1)[0]
        if ctx.needs_input_grad[1]:
            dw = torch_npu.npu_grouped_matmul([x.t()], [dy], group_list=counts, split_item=3, group_type=2,
                                              group_list_type=1)[0]
        return dx, dw, None


def _has_grouped_matmul() -> bool:
    try:
        import torch_npu
    except ImportError:
        return False
    return hasattr(torch_npu, "npu_grouped_matmul")


def npu_fused_moe(hidden_states: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                  top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """fused_moe's contract (see function.py) on an NPU."""
    if not _has_grouped_matmul() or hidden_states.numel() == 0:
        return naive_fused_moe(hidden_states, gate_up_proj, down_proj, top_k_index, top_k_weights)
    experts, hidden, intermediate = down_proj.shape
    x = hidden_states.reshape(-1, hidden)
    flat = top_k_index.reshape(-1).to(torch.int64)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=experts)
    top_k = flat.numel() // x.shape[0]
    gate_up = GroupedMatmul.apply(x[order // top_k], gate_up_proj.transpose(1, 2), counts)
    gate, up = gate_up.split(intermediate, dim=-1)
    y = GroupedMatmul.apply(F.silu(gate) * up, down_proj.transpose(1, 2), counts)
    weighted = y.float() * top_k_weights.reshape(-1)[order, None].float()
    rows = weighted.new_zeros(weighted.shape).index_copy(0, order, weighted)   # back to (token, slot) order
    return rows.view(x.shape[0], top_k, hidden).sum(1).to(hidden_states.dtype).view(hidden_states.shape)
