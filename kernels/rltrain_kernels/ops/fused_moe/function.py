"""FusedMoEFunction (autograd) and the public `fused_moe`: the experts of a top-k routed MoE layer on the grouped GEMMs.

Forward (the routed rows sorted by expert once, routing.py; no host sync):
    gu, h = up_swiglu_forward(x)                      x[token] @ gate_up_proj[e]ᵀ, silu(gate) · up
    rows  = scatter_gemm(h, down_proj) · w            at each row's (token, slot) position
    out   = rows.view(T, k, H).sum(1)                 the k experts of a token, fp32 sum, in a fixed order
Backward, for the upstream gradient dO:
    dgu, dw = down_backward(dO)                       dh' = dO[token] @ down_proj[e]; dw = ⟨dh', h⟩; d(gate|up)
    dx    = scatter_gemm(dgu, gate_up_proj).view(T, k, H).sum(1)
    d gate_up_proj, d down_proj                       weight_grad.py, per expert over its rows
Saved for backward: the inputs and gate|up ([TK, 2I] in x's dtype; h is recomputed from it; a call that needs no
gradient does not store it). Every reduction has a fixed order (no atomics): the results are deterministic.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from rltrain_kernels.ops.common.precision import raw_precision
from rltrain_kernels.ops.fused_moe.grouped_gemm import down_backward, row_tile, scatter_gemm, up_swiglu_forward
from rltrain_kernels.ops.fused_moe.naive import naive_fused_moe
from rltrain_kernels.ops.fused_moe.routing import Routing, sort_by_expert
from rltrain_kernels.ops.fused_moe.tuning import DEFAULT_MOE_TUNING, MoeTuning
from rltrain_kernels.ops.fused_moe.weight_grad import down_weight_grad, gate_up_weight_grad
from rltrain_kernels.utils import triton_interpreted

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _unit_columns(t: torch.Tensor) -> torch.Tensor:
    """t with unit column stride (any row stride, a zero one included), copied only when it has none."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _sum_slots(rows: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """[TK, H] rows in (token, slot) order → [T, H], the k slots of each token summed (fp32 accumulation)."""
    return rows.view(n_tokens, -1, rows.shape[-1]).sum(1)


class FusedMoEFunction(torch.autograd.Function):
    """apply(x [T, H], gate_up_proj [E, 2I, H], down_proj [E, H, I], top_k_index [T, k], top_k_weights [T, k],
    differentiable, tuning) -> out [T, H]; differentiable=False (no gradient will be asked for) skips storing
    gate|up; tuning: the kernels' tiles and launches (tuning.py)."""

    @staticmethod
    def forward(ctx, x, gate_up_proj, down_proj, top_k_index, top_k_weights, differentiable, tuning):
        x = _unit_columns(x)
        weights = top_k_weights.reshape(-1).contiguous()
        routing = sort_by_expert(top_k_index, gate_up_proj.shape[0], row_tile(tuning))
        dot_prec = raw_precision(x.dtype)
        gu, h = up_swiglu_forward(x, gate_up_proj, routing, dot_prec, store_gu=differentiable, tuning=tuning)
        out = _sum_slots(scatter_gemm(h, down_proj, 2, routing, dot_prec, scale=weights, tuning=tuning), x.shape[0])
        ctx.save_for_backward(x, gate_up_proj, down_proj, weights, gu, *routing.tensors())
        ctx.top_k, ctx.block_m, ctx.dot_prec, ctx.tuning = routing.top_k, routing.block_m, dot_prec, tuning
        ctx.weights_shape, ctx.weights_dtype = top_k_weights.shape, top_k_weights.dtype
        return out

    @staticmethod
    @once_differentiable  # the backward kernels are not themselves differentiable
    def backward(ctx, d_out):
        x, gate_up_proj, down_proj, weights, gu, *routing_tensors = ctx.saved_tensors
        routing = Routing(*routing_tensors, top_k=ctx.top_k, block_m=ctx.block_m)
        need_x, need_gate_up, need_down, _, need_weights, _, _ = ctx.needs_input_grad
        d_out = _unit_columns(d_out)
        dx = d_gate_up = d_down = d_weights = None
        if need_x or need_gate_up or need_weights:
            dgu, dw = down_backward(d_out, down_proj, gu, weights, routing, ctx.dot_prec, tuning=ctx.tuning)
            if need_weights:
                d_weights = dw.view(ctx.weights_shape).to(ctx.weights_dtype)
            if need_x:
                dx = _sum_slots(scatter_gemm(dgu, gate_up_proj, 1, routing, ctx.dot_prec, tuning=ctx.tuning),
                                x.shape[0])
            if need_gate_up:
                d_gate_up = gate_up_weight_grad(dgu, x, routing, gate_up_proj.dtype, ctx.dot_prec, tuning=ctx.tuning)
        if need_down:
            d_down = down_weight_grad(d_out, gu, weights, routing, down_proj.dtype, ctx.dot_prec, tuning=ctx.tuning)
        return dx, d_gate_up, d_down, None, d_weights, None, None


def _check(hidden_states, gate_up_proj, down_proj, top_k_index, top_k_weights) -> None:
    if gate_up_proj.dim() != 3 or down_proj.dim() != 3:
        raise ValueError(f"fused_moe: gate_up_proj must be [E, 2I, H] and down_proj [E, H, I]; got "
                         f"{tuple(gate_up_proj.shape)} and {tuple(down_proj.shape)}")
    experts, hidden, intermediate = down_proj.shape
    if gate_up_proj.shape != (experts, 2 * intermediate, hidden):
        raise ValueError(f"fused_moe: gate_up_proj {tuple(gate_up_proj.shape)} does not match down_proj "
                         f"{tuple(down_proj.shape)}: expected [{experts}, {2 * intermediate}, {hidden}]")
    if hidden_states.shape[-1] != hidden:
        raise ValueError(f"fused_moe: hidden_states' last dim is {hidden_states.shape[-1]}, the experts' hidden "
                         f"size is {hidden}")
    if top_k_index.dtype.is_floating_point or top_k_index.dtype.is_complex or top_k_index.dtype == torch.bool:
        raise ValueError(f"fused_moe: top_k_index must hold integer expert ids; got {top_k_index.dtype}")
    if top_k_weights.shape != top_k_index.shape:
        raise ValueError(f"fused_moe: top_k_weights {tuple(top_k_weights.shape)} must have top_k_index's shape "
                         f"{tuple(top_k_index.shape)}")
    if top_k_index.dim() == 0 or top_k_index.shape[:-1].numel() != hidden_states.shape[:-1].numel():
        raise ValueError(f"fused_moe: top_k_index {tuple(top_k_index.shape)} must have one row of expert ids per "
                         f"token of hidden_states {tuple(hidden_states.shape)}")


def _kernel_supported(hidden_states, gate_up_proj, down_proj) -> bool:
    dtype = hidden_states.dtype
    return ((hidden_states.is_cuda or triton_interpreted()) and dtype in KERNEL_DTYPES
            and gate_up_proj.dtype == dtype and down_proj.dtype == dtype
            and gate_up_proj.device == hidden_states.device and down_proj.device == hidden_states.device)


def fused_moe(hidden_states: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
              top_k_index: torch.Tensor, top_k_weights: torch.Tensor, *,
              tuning: MoeTuning = DEFAULT_MOE_TUNING) -> torch.Tensor:
    """out[t] = Σ_j top_k_weights[t, j] · down_e(silu(gate_e(x_t)) · up_e(x_t)), e = top_k_index[t, j].

    hidden_states [..., H]; gate_up_proj [E, 2I, H] (gate rows first, transformers' layout); down_proj [E, H, I];
    top_k_index [..., k] expert ids in [0, E) (not checked: that would cost a host sync); top_k_weights [..., k] of
    any float dtype (its gradient comes back in it). Returns hidden_states' shape and dtype; differentiable in
    everything but top_k_index. bf16/fp16/fp32 tensors on CUDA (or under the interpreter) with one dtype for the
    hidden states and both weights run the Triton kernels; anything else runs `naive_fused_moe`. tuning: the kernels'
    tiles and launches (tuning.py; the default is what ships), for tuning runs."""
    _check(hidden_states, gate_up_proj, down_proj, top_k_index, top_k_weights)
    if not isinstance(tuning, MoeTuning):
        raise TypeError(f"fused_moe: tuning must be a rltrain_kernels.ops.fused_moe.tuning.MoeTuning; got "
                        f"{type(tuning).__name__}")
    if hidden_states.numel() == 0 or not _kernel_supported(hidden_states, gate_up_proj, down_proj):
        return naive_fused_moe(hidden_states, gate_up_proj, down_proj, top_k_index, top_k_weights)
    x = hidden_states.reshape(-1, hidden_states.shape[-1])
    top_k = top_k_index.shape[-1]
    differentiable = torch.is_grad_enabled() and any(
        t.requires_grad for t in (hidden_states, gate_up_proj, down_proj, top_k_weights))
    out = FusedMoEFunction.apply(x, gate_up_proj, down_proj, top_k_index.reshape(-1, top_k),
                                 top_k_weights.reshape(-1, top_k), differentiable, tuning)
    return out.view(hidden_states.shape)
