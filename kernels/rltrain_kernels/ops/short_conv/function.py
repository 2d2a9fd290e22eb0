"""The short convolution's public entry: the autograd Function over kernel.py and kernel_bwd.py, `short_conv` and the
decode step `short_conv_update`, with their argument checks and naive.py's forms for what the kernels cannot take.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from rltrain_kernels.ops.common.inputs import check_packing
from rltrain_kernels.ops.common.rows import channel_rows, sequence_ids
from rltrain_kernels.ops.short_conv.kernel import (ACTIVATIONS, MAX_WIDTH, short_conv_forward,
                                                   short_conv_update_forward)
from rltrain_kernels.ops.short_conv.kernel_bwd import short_conv_backward
from rltrain_kernels.ops.short_conv.naive import naive_short_conv, naive_short_conv_update
from rltrain_kernels.utils import triton_interpreted

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class ShortConvFunction(torch.autograd.Function):
    """apply(x, weight, bias, residual, initial_state, output_final_state, activation, cu_seqlens) -> (y, final)."""

    @staticmethod
    def forward(ctx, x, weight, bias, residual, initial_state, output_final_state, activation, cu_seqlens):
        B, T, _ = x.shape
        cu_seqlens = None if cu_seqlens is None else cu_seqlens.contiguous()  # the kernels read it densely
        N = check_packing(B, T, cu_seqlens, "tokens of x")
        seq_ids = sequence_ids(cu_seqlens, T) if cu_seqlens is not None else None
        x, weight = channel_rows(x), weight.contiguous()
        bias = bias.contiguous() if bias is not None else None
        residual = channel_rows(residual) if residual is not None else None
        y, final = short_conv_forward(x, weight, bias, residual, initial_state, output_final_state, activation,
                                      cu_seqlens, seq_ids, N)
        ctx.save_for_backward(x, weight, bias, initial_state, cu_seqlens, seq_ids)
        ctx.activation, ctx.num_sequences, ctx.has_residual = activation, N, residual is not None
        ctx.set_materialize_grads(False)  # an unused output (y or the final state) arrives as None
        return y, final

    @staticmethod
    @once_differentiable  # the backward kernels are not themselves differentiable
    def backward(ctx, dy, dfinal):
        x, weight, bias, initial_state, cu_seqlens, seq_ids = ctx.saved_tensors
        needs = ctx.needs_input_grad
        if dy is None and dfinal is None:
            return (None,) * 8
        dy_rows = channel_rows(dy) if dy is not None else torch.zeros_like(x)
        compute_dstate = initial_state is not None and needs[4]
        dx, dw, db, dstate = short_conv_backward(dy_rows, dfinal, x, weight, bias, initial_state, ctx.activation,
                                                 cu_seqlens, seq_ids, ctx.num_sequences, compute_dw=needs[1],
                                                 compute_db=bias is not None and needs[2],
                                                 compute_dstate=compute_dstate)
        if dstate is not None:
            width = initial_state.shape[-1]
            if width > dstate.shape[-1]:  # the columns before the window never reach an output
                dstate = torch.cat([dstate.new_zeros(*dstate.shape[:-1], width - dstate.shape[-1]), dstate], -1)
            dstate = dstate.to(initial_state.dtype)
        dresidual = dy if ctx.has_residual and needs[3] else None
        return (dx, dw.to(weight.dtype) if dw is not None else None, db.to(bias.dtype) if db is not None else None,
                dresidual, dstate, None, None, None)


def _check_activation(activation, name: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"{name}: activation must be None, 'silu' or 'swish', got {activation!r}")


def _check_weight_bias(weight: torch.Tensor, bias: torch.Tensor | None, C: int, device, name: str) -> int:
    if weight.dim() != 2 or weight.shape[0] != C:
        raise ValueError(f"{name}: weight must be [C, W] = [{C}, W], got {tuple(weight.shape)}")
    W = weight.shape[1]
    if not 2 <= W <= MAX_WIDTH:
        raise ValueError(f"{name}: weight's kernel width W must be in [2, {MAX_WIDTH}], got {W}")
    if bias is not None and bias.shape != (C,):
        raise ValueError(f"{name}: bias must be [C] = [{C}], got {tuple(bias.shape)}")
    for label, t in (("weight", weight), ("bias", bias)):
        if t is not None and (not t.is_floating_point() or t.device != device):
            raise ValueError(f"{name}: {label} must be a float tensor on x's device {device}, got {t.dtype} on "
                             f"{t.device}")
    return W


def _kernel_supported(*tensors: torch.Tensor | None) -> bool:
    x = tensors[0]
    return ((x.is_cuda or triton_interpreted()) and all(t is None or t.dtype in _KERNEL_DTYPES for t in tensors))


def short_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None, initial_state: torch.Tensor | None = None,
               output_final_state: bool = False, activation: str | None = None, *,
               cu_seqlens: torch.Tensor | None = None):
    """Causal depthwise convolution of x [B, T, C] with weight [C, W] (+ bias [C]), then `activation` (None, "silu"
    or "swish"), then + residual [B, T, C]. initial_state [N, C, S ≥ W − 1] (N = B, or the number of packed
    sequences): the inputs before each sequence. Returns (y [B, T, C] in x's dtype, final state [N, C, W − 1] in x's
    dtype, or None unless output_final_state). cu_seqlens [N + 1] packs N sequences along T (B = 1)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or not x.is_floating_point():
        raise ValueError(f"short_conv: x must be a float tensor [B, T, C], got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    B, T, C = x.shape
    W = _check_weight_bias(weight, bias, C, x.device, "short_conv")
    _check_activation(activation, "short_conv")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"short_conv: residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    N = check_packing(B, T, cu_seqlens, "tokens of x")
    if initial_state is not None:
        if (initial_state.dim() != 3 or initial_state.shape[:2] != (N, C) or initial_state.shape[2] < W - 1
                or not initial_state.is_floating_point()):
            raise ValueError(f"short_conv: initial_state must be a float tensor [N, C, S >= W - 1] = [{N}, {C}, "
                             f">= {W - 1}], got {tuple(initial_state.shape)} {initial_state.dtype}")
        if initial_state.device != x.device:
            raise ValueError(f"short_conv: initial_state is on {initial_state.device} but x is on {x.device}")
    if not _kernel_supported(x, weight, bias, residual, initial_state):
        return naive_short_conv(x, weight, bias, residual, initial_state, output_final_state, activation,
                                cu_seqlens=cu_seqlens)
    return ShortConvFunction.apply(x, weight, bias, residual, initial_state, output_final_state, activation,
                                   cu_seqlens)


def short_conv_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None = None, activation: str | None = None) -> torch.Tensor:
    """One decoding step: x [B, C] (or [B, 1, C]) is each sequence's next token; conv_state [B, C, S ≥ W − 1] holds
    the previous inputs in its last W − 1 columns and is shifted left by one, x written last, in place (as
    causal-conv1d's causal_conv1d_update). Returns y shaped like x: short_conv's output for that token. Runs the
    kernel when no gradient is needed; otherwise the reference (differentiable in x, weight and bias)."""
    if not isinstance(x, torch.Tensor) or x.dim() not in (2, 3) or (x.dim() == 3 and x.shape[1] != 1):
        raise ValueError(f"short_conv_update: x must be [B, C] or [B, 1, C], got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    B, C = x.shape[0], x.shape[-1]
    W = _check_weight_bias(weight, bias, C, x.device, "short_conv_update")
    _check_activation(activation, "short_conv_update")
    if (conv_state.dim() != 3 or conv_state.shape[:2] != (B, C) or conv_state.shape[2] < W - 1
            or not conv_state.is_floating_point() or conv_state.device != x.device):
        raise ValueError(f"short_conv_update: conv_state must be a float tensor [B, C, S >= W - 1] = [{B}, {C}, "
                         f">= {W - 1}] on {x.device}, got {tuple(conv_state.shape)} {conv_state.dtype} on "
                         f"{conv_state.device}")
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    if grad or not _kernel_supported(x, weight, bias, conv_state):
        return naive_short_conv_update(x, conv_state, weight, bias, activation)
    rows = channel_rows(x.reshape(B, C))
    bias = bias.contiguous() if bias is not None else None   # the kernel reads weight and bias densely
    return short_conv_update_forward(rows, conv_state, weight.contiguous(), bias, activation).reshape(x.shape)
