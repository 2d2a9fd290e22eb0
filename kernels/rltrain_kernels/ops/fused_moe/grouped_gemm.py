"""The grouped GEMMs over the routed rows sorted by expert (routing.py): each program computes one tile of block_m
rows of one expert against that expert's weights, so the 128 experts of a Qwen3-30B-A3B layer run as one launch of
tensor-core tiles instead of a Python loop of small GEMMs.

    up_swiglu_forward   gate / up = x[token] @ gate_up_proj[e]ᵀ, both halves in one program (two accumulators
                        sharing the loads of x), h = silu(gate) · up in the epilogue; stores gate|up and h
    scatter_gemm        a @ W[e] for rows already in sorted order (h for the down projection, d(gate|up) for the
                        hidden states' gradient), optionally scaled by the routing weight, stored at the row's
                        (token, slot) position so the k slots of a token are summed by a plain reshape-sum
    down_backward       dh' = dO[token] @ down_proj[e] (unscaled), and in the epilogue: the routing weight's
                        gradient ⟨dh', h⟩ (per column block, summed after), dh = w·dh', and d(gate|up) through
                        SwiGLU from the stored gate|up

Operands are gathered by index (x[token], dO[token]) with plain loads. The rows past a tile's end are clamped to valid
addresses instead of masked (their results are never stored), so only a ragged N or K needs masks (EVEN_N, EVEN_K
otherwise). A weight tile's columns are masked, never clamped: a clamp hides their contiguity from Triton, whose
loads then go element by element and leave the software pipeline (sm_90 compile: no async copies of that tile).
The products of a tile accumulate in fp32 (precision.mma: bf16/fp16 operands on the tensor cores, fp32 inputs in
"ieee"); gate, up and h are rounded to the input dtype once, in the forward, and the backward recomputes h from the
stored gate|up with the same rounding, so both passes see the same h.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rltrain_kernels.ops.common.precision import cast_for_store, mma
from rltrain_kernels.ops.fused_moe.routing import Routing
from rltrain_kernels.ops.fused_moe.tuning import DEFAULT_MOE_TUNING, MoeTuning
from rltrain_kernels.utils import triton_interpreted

# The row tile and each kernel's (BLOCK_N, BLOCK_K, num_warps, num_stages): tuning.py's MoeTuning.
GROUP_M = 8                     # row tiles that sweep the column blocks together (their x rows stay in L2)
# Under TRITON_INTERPRET=1 (CI): 16-row tiles (several per expert at test sizes) and 32-wide blocks, so the test
# shapes (H 40, I 48) have ragged N and K edges at few programs (the interpreter's cost is per program and step).
INTERPRETED_ROW_TILE, INTERPRETED_BLOCK = 16, 32


@triton.jit
def _grouped_tile(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """(row tile, column block) of program pid in grouped order: GROUP_M row tiles sweep the column blocks
    together, so each weight block is read once per group and the group's gathered rows stay in L2."""
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    local = pid % per_group
    return first_m + local % size_m, local // size_m


@triton.jit
def _rows_dot(a_ptrs, b_ptrs, col_ok, ks, K, stride_wk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, DOT_PREC: tl.constexpr):
    """Σ_k a[:, k] · b[k, :] over K in BLOCK_K steps (fp32): a's rows along a_ptrs (unit K stride), b's K rows
    stride_wk apart; loads past K (and b's columns outside col_ok) masked to 0 unless the shape is even."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b_ok = col_ok[None, :]
        else:
            k_ok = ks < K - k0
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b_ok = col_ok[None, :] & k_ok[:, None]
        if EVEN_N and EVEN_K:
            b = tl.load(b_ptrs)
        else:
            b = tl.load(b_ptrs, mask=b_ok, other=0.0)
        acc = mma(a, b, acc, DOT_PREC)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_wk
    return acc


@triton.jit
def _up_swiglu_kernel(
    x_ptr, stride_x, w_ptr, stride_we, stride_wn, stride_wk,
    order_ptr, tile_expert_ptr, tile_row_ptr, expert_start_ptr,
    gu_ptr, h_ptr, n_tiles, N, K, TOP_K,
    STORE_GU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """gu[r] = [x[t] @ W[e, :N]ᵀ, x[t] @ W[e, N:]ᵀ] (rounded; only with STORE_GU), h[r] = silu(gate) · up, for
    sorted rows r of token t."""
    pid_m, pid_n = _grouped_tile(tl.program_id(0), n_tiles, tl.cdiv(N, BLOCK_N), GROUP_M)
    expert = tl.load(tile_expert_ptr + pid_m)
    if expert < 0:
        return
    rows = tl.load(tile_row_ptr + pid_m) + tl.arange(0, BLOCK_M)
    row_ok = rows < tl.load(expert_start_ptr + expert + 1)
    tokens = tl.load(order_ptr + rows, mask=row_ok, other=0) // TOP_K
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tokens[:, None] * stride_x + ks[None, :]
    g_ptrs = w_ptr + expert.to(tl.int64) * stride_we + cols[None, :] * stride_wn + ks[:, None] * stride_wk
    up = N * stride_wn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b_ok = col_ok[None, :]
        else:
            k_ok = ks < K - k0
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b_ok = col_ok[None, :] & k_ok[:, None]
        if EVEN_N and EVEN_K:
            bg = tl.load(g_ptrs)
            bu = tl.load(g_ptrs + up)
        else:
            bg = tl.load(g_ptrs, mask=b_ok, other=0.0)
            bu = tl.load(g_ptrs + up, mask=b_ok, other=0.0)
        acc_g = mma(a, bg, acc_g, DOT_PREC)
        acc_u = mma(a, bu, acc_u, DOT_PREC)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K * stride_wk
    gate = cast_for_store(acc_g, gu_ptr, DOT_PREC)
    upv = cast_for_store(acc_u, gu_ptr, DOT_PREC)
    g = gate.to(tl.float32)
    h = g * tl.sigmoid(g) * upv.to(tl.float32)
    mask = row_ok[:, None] & col_ok[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    if STORE_GU:
        tl.store(gu_ptr + rows64 * (2 * N) + cols[None, :], gate, mask=mask)
        tl.store(gu_ptr + rows64 * (2 * N) + N + cols[None, :], upv, mask=mask)
    tl.store(h_ptr + rows64 * N + cols[None, :], cast_for_store(h, h_ptr, DOT_PREC), mask=mask)


@triton.jit
def _scatter_gemm_kernel(
    a_ptr, stride_a, w_ptr, stride_we, stride_wk, stride_wn,
    order_ptr, weights_ptr, tile_expert_ptr, tile_row_ptr, expert_start_ptr,
    out_ptr, stride_out, n_tiles, N, K,
    SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """out[order[r]] = (w[order[r]] ·) a[r] @ W[e] for sorted rows r of expert e, W[e][k, n] at
    w_ptr + e·stride_we + k·stride_wk + n·stride_wn."""
    pid_m, pid_n = _grouped_tile(tl.program_id(0), n_tiles, tl.cdiv(N, BLOCK_N), GROUP_M)
    expert = tl.load(tile_expert_ptr + pid_m)
    if expert < 0:
        return
    rows = tl.load(tile_row_ptr + pid_m) + tl.arange(0, BLOCK_M)
    row_ok = rows < tl.load(expert_start_ptr + expert + 1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + tl.where(row_ok, rows, 0).to(tl.int64)[:, None] * stride_a + ks[None, :]
    b_ptrs = w_ptr + expert.to(tl.int64) * stride_we + ks[:, None] * stride_wk + cols[None, :] * stride_wn
    acc = _rows_dot(a_ptrs, b_ptrs, col_ok, ks, K, stride_wk, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_N, EVEN_K, DOT_PREC)
    flat = tl.load(order_ptr + rows, mask=row_ok, other=0)
    if SCALE:
        acc = acc * tl.load(weights_ptr + flat, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + flat[:, None] * stride_out + cols[None, :], cast_for_store(acc, out_ptr, DOT_PREC),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _down_backward_kernel(
    dy_ptr, stride_dy, w_ptr, stride_we, stride_wk, stride_wn,
    gu_ptr, order_ptr, weights_ptr, tile_expert_ptr, tile_row_ptr, expert_start_ptr,
    dgu_ptr, dw_part_ptr, n_tiles, N, K, TOP_K, ROUTED,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """dh' = dy[t] @ down[e] ([K = H] → [N = I]) for sorted rows r of token t; then dw_part[column block, order[r]] =
    ⟨dh', h⟩ over the block's columns, and dgu[r] = d(gate|up) of dh = w·dh' through h = silu(gate) · up."""
    pid_m, pid_n = _grouped_tile(tl.program_id(0), n_tiles, tl.cdiv(N, BLOCK_N), GROUP_M)
    expert = tl.load(tile_expert_ptr + pid_m)
    if expert < 0:
        return
    rows = tl.load(tile_row_ptr + pid_m) + tl.arange(0, BLOCK_M)
    row_ok = rows < tl.load(expert_start_ptr + expert + 1)
    flat = tl.load(order_ptr + rows, mask=row_ok, other=0)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = dy_ptr + (flat // TOP_K)[:, None] * stride_dy + ks[None, :]
    b_ptrs = w_ptr + expert.to(tl.int64) * stride_we + ks[:, None] * stride_wk + cols[None, :] * stride_wn
    acc = _rows_dot(a_ptrs, b_ptrs, col_ok, ks, K, stride_wk, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_N, EVEN_K, DOT_PREC)
    mask = row_ok[:, None] & col_ok[None, :]
    gu = gu_ptr + rows.to(tl.int64)[:, None] * (2 * N) + cols[None, :]
    g = tl.load(gu, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu + N, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    h = cast_for_store(silu * u, gu_ptr, DOT_PREC).to(tl.float32)   # the forward's h, rounded the same way
    tl.store(dw_part_ptr + pid_n * ROUTED + flat, tl.sum(acc * h, axis=1), mask=row_ok)
    dh = acc * tl.load(weights_ptr + flat, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    dgate = dh * u * sig * (1.0 + g * (1.0 - sig))
    dgu = dgu_ptr + rows.to(tl.int64)[:, None] * (2 * N) + cols[None, :]
    tl.store(dgu, cast_for_store(dgate, dgu_ptr, DOT_PREC), mask=mask)
    tl.store(dgu + N, cast_for_store(dh * silu, dgu_ptr, DOT_PREC), mask=mask)


def _launch(setting: tuple[int, int, int, int], routing: Routing, n_cols: int,
            dtype: torch.dtype) -> tuple[tuple[int], dict]:
    """(grid, block keywords) of a kernel launched at `setting` (BLOCK_N, BLOCK_K, num_warps, num_stages: a MoeTuning
    field) over routing's tiles and n_cols output columns."""
    if triton_interpreted():
        block_n, block_k, num_warps, num_stages = INTERPRETED_BLOCK, INTERPRETED_BLOCK, 1, 1
    else:
        block_n, block_k, num_warps, num_stages = setting
        if dtype == torch.float32:
            num_stages = min(num_stages, 2)
    grid = (routing.n_tiles * triton.cdiv(n_cols, block_n),)
    return grid, dict(BLOCK_M=routing.block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=GROUP_M,
                      EVEN_N=n_cols % block_n == 0, num_warps=num_warps, num_stages=num_stages)


def row_tile(tuning: MoeTuning = DEFAULT_MOE_TUNING) -> int:
    """Rows per tile for the Routing of these kernels (small under the interpreter)."""
    return INTERPRETED_ROW_TILE if triton_interpreted() else tuning.row_tile


def up_swiglu_forward(x: torch.Tensor, gate_up_proj: torch.Tensor, routing: Routing, dot_prec: str,
                      store_gu: bool = True, tuning: MoeTuning = DEFAULT_MOE_TUNING):
    """(gu [TK, 2I] or None without store_gu, h [TK, I]) in sorted row order, x's dtype; x [T, H] with unit column
    stride. gu is what the backward needs: a forward without one skips its stores."""
    routed, n = routing.order.shape[0], gate_up_proj.shape[1] // 2
    h = torch.empty(routed, n, dtype=x.dtype, device=x.device)
    gu = torch.empty(routed, 2 * n, dtype=x.dtype, device=x.device) if store_gu else None
    grid, blocks = _launch(tuning.up_swiglu, routing, n, x.dtype)
    k = x.shape[1]
    _up_swiglu_kernel[grid](
        x, x.stride(0), gate_up_proj, *gate_up_proj.stride(), *routing.tensors(), h if gu is None else gu, h,
        routing.n_tiles, n, k, routing.top_k, STORE_GU=store_gu, EVEN_K=k % blocks["BLOCK_K"] == 0,
        DOT_PREC=dot_prec, **blocks)
    return gu, h


def scatter_gemm(a: torch.Tensor, weight: torch.Tensor, reduce_dim: int, routing: Routing, dot_prec: str,
                 scale: torch.Tensor | None = None, tuning: MoeTuning = DEFAULT_MOE_TUNING) -> torch.Tensor:
    """[TK, N] in (token, slot) order: row order[r] = a[r] @ W[e] (· scale[order[r]] when scale is given), W[e] the
    expert's weight [E, ., .] reduced over dim `reduce_dim` (1 or 2; N is the other)."""
    k_dim, n_dim = (1, 2) if reduce_dim == 1 else (2, 1)
    n = weight.shape[n_dim]
    out = torch.empty(routing.order.shape[0], n, dtype=a.dtype, device=a.device)
    grid, blocks = _launch(tuning.scatter, routing, n, a.dtype)
    k = weight.shape[k_dim]
    _scatter_gemm_kernel[grid](
        a, a.stride(0), weight, weight.stride(0), weight.stride(k_dim), weight.stride(n_dim),
        routing.order, scale if scale is not None else a, *routing.tensors()[1:], out, out.stride(0),
        routing.n_tiles, n, k, SCALE=scale is not None, EVEN_K=k % blocks["BLOCK_K"] == 0, DOT_PREC=dot_prec,
        **blocks)
    return out


def down_backward(dy: torch.Tensor, down_proj: torch.Tensor, gu: torch.Tensor, weights: torch.Tensor,
                  routing: Routing, dot_prec: str,
                  tuning: MoeTuning = DEFAULT_MOE_TUNING) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgu [TK, 2I] sorted, d weights [TK] fp32 in (token, slot) order) for the upstream gradient dy [T, H]."""
    routed, n, k = routing.order.shape[0], down_proj.shape[2], down_proj.shape[1]
    dgu = torch.empty_like(gu)
    grid, blocks = _launch(tuning.down_backward, routing, n, gu.dtype)
    dw_part = torch.empty(triton.cdiv(n, blocks["BLOCK_N"]), routed, dtype=torch.float32, device=gu.device)
    _down_backward_kernel[grid](
        dy, dy.stride(0), down_proj, down_proj.stride(0), down_proj.stride(1), down_proj.stride(2), gu,
        routing.order, weights, *routing.tensors()[1:], dgu, dw_part, routing.n_tiles, n, k, routing.top_k, routed,
        EVEN_K=k % blocks["BLOCK_K"] == 0, DOT_PREC=dot_prec, **blocks)
    return dgu, dw_part.sum(0)
