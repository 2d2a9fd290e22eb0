"""Token shift's public entry: the autograd Function over kernel.py and `token_shift` (the kernels, or naive.py's form
for what they cannot take).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from rltrain_kernels.ops.common.inputs import check_packing
from rltrain_kernels.ops.common.rows import channel_rows, sequence_ids
from rltrain_kernels.ops.token_shift.kernel import token_shift_backward, token_shift_forward
from rltrain_kernels.ops.token_shift.naive import naive_token_shift
from rltrain_kernels.utils import triton_interpreted

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class TokenShiftFunction(torch.autograd.Function):
    """apply(x, cu_seqlens, cache, output_cache) -> (out, cache_out or None)."""

    @staticmethod
    def forward(ctx, x, cu_seqlens, cache, output_cache):
        B, T, _ = x.shape
        cu_seqlens = None if cu_seqlens is None else cu_seqlens.contiguous()  # the kernels read it densely
        N = check_packing(B, T, cu_seqlens, "tokens of x")
        seq_ids = sequence_ids(cu_seqlens, T) if cu_seqlens is not None else None
        out, cache_out = token_shift_forward(channel_rows(x), cu_seqlens, seq_ids,
                                             cache.contiguous() if cache is not None else None, output_cache, N)
        ctx.save_for_backward(cu_seqlens, seq_ids)
        ctx.num_sequences, ctx.cache_dtype = N, cache.dtype if cache is not None else None
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        ctx.set_materialize_grads(False)  # an unused output arrives as None
        return out, cache_out

    @staticmethod
    @once_differentiable  # the backward kernel is not itself differentiable
    def backward(ctx, dout, dcache_out):
        cu_seqlens, seq_ids = ctx.saved_tensors
        if dout is None and dcache_out is None:
            return None, None, None, None
        if dout is None:  # only the returned cache reaches the loss
            dout = dcache_out.new_zeros(ctx.x_shape, dtype=ctx.x_dtype)
        compute_dcache = ctx.cache_dtype is not None and ctx.needs_input_grad[2]
        dx, dcache = token_shift_backward(channel_rows(dout), dcache_out, cu_seqlens, seq_ids, compute_dcache,
                                          ctx.num_sequences, ctx.cache_dtype)
        return dx, None, dcache, None


def token_shift(x: torch.Tensor, cu_seqlens: torch.Tensor | None = None, cache: torch.Tensor | None = None,
                output_cache: bool = False):
    """delta[t] = x[t − 1] − x[t] per sequence of x [B, T, D], x[−1] = cache [N, D] (N = B, or the number of packed
    sequences) or 0. Returns delta [B, T, D] in x's dtype, and with output_cache=True also the cache for the next
    call: each sequence's last token [N, D] (an empty packed sequence passes its cache on)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or not x.is_floating_point():
        raise ValueError(f"token_shift: x must be a float tensor [B, T, D], got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    B, T, D = x.shape
    N = check_packing(B, T, cu_seqlens, "tokens of x")
    if cache is not None:
        if cache.shape != (N, D) or not cache.is_floating_point():
            raise ValueError(f"token_shift: cache must be a float tensor [N, D] = [{N}, {D}], got "
                             f"{tuple(cache.shape)} {cache.dtype}")
        if cache.device != x.device:
            raise ValueError(f"token_shift: cache is on {cache.device} but x is on {x.device}")
    kernel = ((x.is_cuda or triton_interpreted()) and x.dtype in _KERNEL_DTYPES
              and (cache is None or cache.dtype in _KERNEL_DTYPES))
    if not kernel:
        return naive_token_shift(x, cu_seqlens, cache, output_cache)
    out, cache_out = TokenShiftFunction.apply(x, cu_seqlens, cache, output_cache)
    return (out, cache_out) if output_cache else out
