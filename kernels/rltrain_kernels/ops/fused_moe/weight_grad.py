"""The experts' weight gradients: for each expert e, a GEMM that reduces over that expert's routed rows,

    d gate_up_proj[e] = Σ_r d(gate|up)[r]ᵀ ⊗ x[token(r)]          [2I, H]
    d down_proj[e]    = Σ_r dO[token(r)]ᵀ ⊗ (w_r · h[r])           [H, I], h recomputed from the stored gate|up

one program per (expert, output tile), walking the expert's rows in chunks of BLOCK_K with the row operands gathered
by index and the routing weight folded into the recomputed h. Columns past M or N are masked (only when the tile is
ragged: EVEN_M, EVEN_N), never clamped, which would hide their contiguity and take the loads off the pipeline. The
whole reduction of a tile stays in one program's fp32 accumulator (no split over rows, no atomics): deterministic,
one rounding to the weight's dtype, and an expert no token picked writes zeros. Programs run expert-major, so the
few experts in flight keep their rows in L2 while every output tile of theirs reads them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rltrain_kernels.ops.common.precision import cast_for_store, mma
from rltrain_kernels.ops.fused_moe.routing import Routing
from rltrain_kernels.ops.fused_moe.tuning import DEFAULT_MOE_TUNING, MoeTuning
from rltrain_kernels.utils import triton_interpreted

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for fp32 inputs ("ieee" dots, off the tensor cores); bf16 and
# fp16 take MoeTuning.weight_grad (tuning.py). 64 × 64 tiles: at 128 × 128 the down projection's gradient spilled
# 11 KiB per thread.
LAUNCH_FP32 = (64, 64, 32, 4, 2)
INTERPRETED_BLOCKS = (32, 32, 16)   # (BLOCK_M, BLOCK_N, BLOCK_K) under TRITON_INTERPRET=1: ragged tiles, few programs


@triton.jit
def _expert_weight_grad_kernel(
    a_ptr, stride_a, b_ptr, stride_b, up_offset, order_ptr, weights_ptr, expert_start_ptr, dw_ptr, M, N, TOP_K,
    A_GATHER: tl.constexpr, B_GATHER: tl.constexpr, B_SWIGLU: tl.constexpr, EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """dw[e] [M, N] = Σ over expert e's sorted rows r of A[r, :M]ᵀ ⊗ B[r, :N]. A[r] is row token(r) of a (A_GATHER)
    or row r; B[r] likewise of b, or with B_SWIGLU w_r · silu(g) · u from the gate|up row r of b (u at up_offset)."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    expert = pid // (num_m * num_n)
    local = pid % (num_m * num_n)
    ms = (local // num_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = (local % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = ms < M
    n_ok = ns < N
    start = tl.load(expert_start_ptr + expert)
    end = tl.load(expert_start_ptr + expert + 1)
    steps = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(start, end, BLOCK_K):
        rs = r0 + steps
        r_ok = rs < end
        flat = tl.load(order_ptr + rs, mask=r_ok, other=0)
        if A_GATHER:
            a_rows = flat // TOP_K
        else:
            a_rows = rs.to(tl.int64)
        if B_GATHER:
            b_rows = flat // TOP_K
        else:
            b_rows = rs.to(tl.int64)
        a_ok = r_ok[None, :] if EVEN_M else r_ok[None, :] & m_ok[:, None]
        b_ok = r_ok[:, None] if EVEN_N else r_ok[:, None] & n_ok[None, :]
        a = tl.load(a_ptr + a_rows[None, :] * stride_a + ms[:, None], mask=a_ok, other=0.0)
        b_ptrs = b_ptr + b_rows[:, None] * stride_b + ns[None, :]
        b = tl.load(b_ptrs, mask=b_ok, other=0.0)
        if B_SWIGLU:
            g = b.to(tl.float32)
            u = tl.load(b_ptrs + up_offset, mask=b_ok, other=0.0).to(tl.float32)
            h = cast_for_store(g * tl.sigmoid(g) * u, b_ptr, DOT_PREC).to(tl.float32)  # the forward's h
            b = h * tl.load(weights_ptr + flat, mask=r_ok, other=0.0).to(tl.float32)[:, None]
        acc = mma(a, b, acc, DOT_PREC)
    out = dw_ptr + expert.to(tl.int64) * M * N + ms[:, None] * N + ns[None, :]
    tl.store(out, cast_for_store(acc, dw_ptr, DOT_PREC), mask=m_ok[:, None] & n_ok[None, :])


def _run(a, b, up_offset, weights, routing: Routing, shape, dtype, a_gather, b_gather, b_swiglu, dot_prec,
         tuning: MoeTuning):
    num_experts = routing.expert_start.shape[0] - 1
    m, n = shape
    dw = torch.empty(num_experts, m, n, dtype=dtype, device=a.device)
    if triton_interpreted():
        block_m, block_n, block_k = INTERPRETED_BLOCKS
        num_warps, num_stages = 1, 1
    else:
        block_m, block_n, block_k, num_warps, num_stages = (LAUNCH_FP32 if a.dtype == torch.float32
                                                            else tuning.weight_grad)
    grid = (num_experts * triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _expert_weight_grad_kernel[grid](
        a, a.stride(0), b, b.stride(0), up_offset, routing.order, weights, routing.expert_start, dw, m, n,
        routing.top_k, A_GATHER=a_gather, B_GATHER=b_gather, B_SWIGLU=b_swiglu, EVEN_M=m % block_m == 0,
        EVEN_N=n % block_n == 0, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, DOT_PREC=dot_prec, num_warps=num_warps, num_stages=num_stages)
    return dw


def gate_up_weight_grad(dgu: torch.Tensor, x: torch.Tensor, routing: Routing, dtype: torch.dtype,
                        dot_prec: str, tuning: MoeTuning = DEFAULT_MOE_TUNING) -> torch.Tensor:
    """d gate_up_proj [E, 2I, H] in `dtype` from dgu [TK, 2I] (sorted) and x [T, H] (unit column stride)."""
    return _run(dgu, x, 0, dgu, routing, (dgu.shape[1], x.shape[1]), dtype, False, True, False, dot_prec, tuning)


def down_weight_grad(dy: torch.Tensor, gu: torch.Tensor, weights: torch.Tensor, routing: Routing,
                     dtype: torch.dtype, dot_prec: str, tuning: MoeTuning = DEFAULT_MOE_TUNING) -> torch.Tensor:
    """d down_proj [E, H, I] in `dtype` from dy [T, H] (unit column stride), gu [TK, 2I] (sorted) and the flat
    routing weights [TK]."""
    n = gu.shape[1] // 2
    return _run(dy, gu, n, weights, routing, (dy.shape[1], n), dtype, True, False, True, dot_prec, tuning)
