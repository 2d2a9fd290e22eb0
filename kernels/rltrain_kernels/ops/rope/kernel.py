"""Fused rotary position embedding (HF's rotate_half convention) as Triton kernels, forward and backward.

Why a kernel: eager RoPE runs ~10 kernels per call (two rotate_half concatenations, four multiplies, two adds, for
q and k) and materialises the rotated copies; the fused kernel reads q, k, cos, sin once and writes q_embed, k_embed
once. One program handles one (batch, token) and all heads of q and k, so that token's cos/sin rows are loaded once
for Hq + Hk heads (40 heads for Llama-3-8B: 32 q + 8 kv).

Maths (x = [x1, x2], cos = [c1, c2], sin = [s1, s2], halves of the head dim D; all four halves loaded, so cos and
sin need not repeat across the halves as they do in HF's default rotary embedding):
    forward:  o1 = x1·c1 − x2·s1,   o2 = x2·c2 + x1·s2
    backward: the transpose, d1 = g1·c1 + g2·s2,  d2 = g2·c2 − g1·s1
so the backward is the forward kernel with (s1, s2) replaced by (−s2, −s1).

Any strides are accepted for q, k (typically [B, T, H, D] buffers seen through .transpose(1, 2)), cos/sin and the
upstream gradients, as long as the head dim has unit stride (else that operand is copied once). The same kernels run
on CPU tensors under TRITON_INTERPRET=1, which is how CI tests them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Head chunk per loop step: ≤ 2048 values per half-tile (32 heads × 64 at D=128: all of Llama's q heads in one step,
# 16 fp32 registers per thread per half at 4 warps).
MAX_TILE = 2048
# Warps per program (one token); bench_norm_act_rope.py --sweep times the alternatives. A token whose q and k heads
# each fit one tile issues all four loads before its first store (ONE_TILE: more bytes in flight per program; a store
# may alias a later load, so the compiler cannot hoist them itself). H200, bf16, 16384 tokens × (32 q + 8 k heads) ×
# 128: forward 100 us at 4 warps → 85 us with hoisted loads (96% of copy); 1 and 2 warps 97–99 us either way.
NUM_WARPS = 4


@triton.jit
def _rotate_heads(x_ptr, x_head_stride, o_ptr, o_head_stride, n_heads, half_dim,
                  c1, c2, sa, sb, d, d_mask, BLOCK_H: tl.constexpr):
    """o1 = x1·c1 − x2·sa, o2 = x2·c2 + x1·sb for every head of one token; c*/s* are fp32 [BLOCK_HALF] rows."""
    for h0 in range(0, n_heads, BLOCK_H):
        heads = (h0 + tl.arange(0, BLOCK_H)).to(tl.int64)
        mask = (heads < n_heads)[:, None] & d_mask[None, :]
        x_offs = heads[:, None] * x_head_stride + d[None, :]
        o_offs = heads[:, None] * o_head_stride + d[None, :]
        x1 = tl.load(x_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + x_offs + half_dim, mask=mask, other=0.0).to(tl.float32)
        o1 = x1 * c1[None, :] - x2 * sa[None, :]
        o2 = x2 * c2[None, :] + x1 * sb[None, :]
        tl.store(o_ptr + o_offs, o1.to(o_ptr.dtype.element_ty), mask=mask)
        tl.store(o_ptr + o_offs + half_dim, o2.to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _load_heads(x_ptr, x_head_stride, n_heads, half_dim, d, d_mask, BLOCK_H: tl.constexpr):
    """Both halves of heads 0..BLOCK_H-1 of one token, fp32, and their mask (the one-tile path)."""
    heads = tl.arange(0, BLOCK_H).to(tl.int64)
    mask = (heads < n_heads)[:, None] & d_mask[None, :]
    offs = heads[:, None] * x_head_stride + d[None, :]
    x1 = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + offs + half_dim, mask=mask, other=0.0).to(tl.float32)
    return x1, x2, mask


@triton.jit
def _store_rotated(o_ptr, o_head_stride, x1, x2, mask, half_dim, c1, c2, sa, sb, d, BLOCK_H: tl.constexpr):
    heads = tl.arange(0, BLOCK_H).to(tl.int64)
    offs = heads[:, None] * o_head_stride + d[None, :]
    tl.store(o_ptr + offs, (x1 * c1[None, :] - x2 * sa[None, :]).to(o_ptr.dtype.element_ty), mask=mask)
    tl.store(o_ptr + offs + half_dim, (x2 * c2[None, :] + x1 * sb[None, :]).to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr, q_batch_stride, q_head_stride, q_token_stride,
    qo_ptr, qo_batch_stride, qo_head_stride, qo_token_stride,
    k_ptr, k_batch_stride, k_head_stride, k_token_stride,
    ko_ptr, ko_batch_stride, ko_head_stride, ko_token_stride,
    cos_ptr, cos_batch_stride, cos_token_stride,
    sin_ptr, sin_batch_stride, sin_token_stride,
    n_tokens, n_q_heads, n_k_heads, half_dim,
    DO_Q: tl.constexpr, DO_K: tl.constexpr, BACKWARD: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr, ONE_TILE: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    b = pid // n_tokens
    t = pid % n_tokens
    d = tl.arange(0, BLOCK_HALF)
    d_mask = d < half_dim
    cos_row = cos_ptr + b * cos_batch_stride + t * cos_token_stride
    sin_row = sin_ptr + b * sin_batch_stride + t * sin_token_stride
    c1 = tl.load(cos_row + d, mask=d_mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_row + half_dim + d, mask=d_mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_row + d, mask=d_mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_row + half_dim + d, mask=d_mask, other=0.0).to(tl.float32)
    if BACKWARD:  # transpose of the rotation: (s1, s2) -> (-s2, -s1)
        sa = -s2
        sb = -s1
    else:
        sa = s1
        sb = s2
    q_in = q_ptr + b * q_batch_stride + t * q_token_stride
    k_in = k_ptr + b * k_batch_stride + t * k_token_stride
    if ONE_TILE:  # every load of this token before its first store
        if DO_Q:
            q1, q2, q_mask = _load_heads(q_in, q_head_stride, n_q_heads, half_dim, d, d_mask, BLOCK_HQ)
        if DO_K:
            k1, k2, k_mask = _load_heads(k_in, k_head_stride, n_k_heads, half_dim, d, d_mask, BLOCK_HK)
        if DO_Q:
            _store_rotated(qo_ptr + b * qo_batch_stride + t * qo_token_stride, qo_head_stride, q1, q2, q_mask,
                           half_dim, c1, c2, sa, sb, d, BLOCK_HQ)
        if DO_K:
            _store_rotated(ko_ptr + b * ko_batch_stride + t * ko_token_stride, ko_head_stride, k1, k2, k_mask,
                           half_dim, c1, c2, sa, sb, d, BLOCK_HK)
    else:
        if DO_Q:
            _rotate_heads(q_in, q_head_stride,
                          qo_ptr + b * qo_batch_stride + t * qo_token_stride, qo_head_stride,
                          n_q_heads, half_dim, c1, c2, sa, sb, d, d_mask, BLOCK_HQ)
        if DO_K:
            _rotate_heads(k_in, k_head_stride,
                          ko_ptr + b * ko_batch_stride + t * ko_token_stride, ko_head_stride,
                          n_k_heads, half_dim, c1, c2, sa, sb, d, d_mask, BLOCK_HK)


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _bhtd_strides(t: torch.Tensor | None) -> tuple[int, int, int]:
    """(batch, head, token) strides of a [B, H, T, D] view (zeros for an absent operand)."""
    return (t.stride(0), t.stride(1), t.stride(2)) if t is not None else (0, 0, 0)


def _cos_sin_strides(t: torch.Tensor) -> tuple[int, int]:
    """(batch, token) strides of a [B or 1, T, D] cos/sin; batch stride 0 broadcasts one table over the batch."""
    return (t.stride(0) if t.shape[0] > 1 else 0), t.stride(1)


def rope_apply(q: torch.Tensor | None, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
               q_out_dtype: torch.dtype, k_out_dtype: torch.dtype, backward: bool = False):
    """Rotate q [B, Hq, T, D] and k [B, Hk, T, D] (any strides; either may be None) by cos/sin [B or 1, T, D].
    Outputs keep the operand's memory layout when it is dense (so a transposed [B, T, H, D] buffer gives one too).
    backward=True applies the transposed rotation (the gradient)."""
    ref = q if q is not None else k
    batch, _, n_tokens, head_dim = ref.shape
    q = _unit_last(q) if q is not None else None
    k = _unit_last(k) if k is not None else None
    cos, sin = _unit_last(cos), _unit_last(sin)
    q_out = torch.empty_like(q, dtype=q_out_dtype) if q is not None else None
    k_out = torch.empty_like(k, dtype=k_out_dtype) if k is not None else None
    n_q_heads = q.shape[1] if q is not None else 0
    n_k_heads = k.shape[1] if k is not None else 0
    if batch * n_tokens == 0 or n_q_heads + n_k_heads == 0:
        return q_out, k_out
    half = head_dim // 2
    block_half = triton.next_power_of_2(half)
    cap = max(1, MAX_TILE // block_half)
    block_hq = min(triton.next_power_of_2(max(n_q_heads, 1)), cap)
    block_hk = min(triton.next_power_of_2(max(n_k_heads, 1)), cap)
    # Dummy pointers for an absent operand (its branch is compiled out through DO_Q / DO_K).
    q_arg, qo_arg = (q, q_out) if q is not None else (k, k_out)
    k_arg, ko_arg = (k, k_out) if k is not None else (q, q_out)
    _rope_kernel[(batch * n_tokens,)](
        q_arg, *_bhtd_strides(q), qo_arg, *_bhtd_strides(q_out),
        k_arg, *_bhtd_strides(k), ko_arg, *_bhtd_strides(k_out),
        cos, *_cos_sin_strides(cos), sin, *_cos_sin_strides(sin),
        n_tokens, n_q_heads, n_k_heads, half,
        DO_Q=q is not None, DO_K=k is not None, BACKWARD=backward,
        BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_HALF=block_half,
        ONE_TILE=block_hq >= n_q_heads and block_hk >= n_k_heads, num_warps=NUM_WARPS,
    )
    return q_out, k_out
