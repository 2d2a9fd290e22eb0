"""The short convolution's forward Triton kernels and their host functions: the convolution, the final state, and the
single-token decode step; plus the state rows and tap loads the backward (kernel_bwd.py) shares. The row bookkeeping
(row_info, sequence_ids) it shares with token shift is common/rows.py's.

Layout: tokens are the flattened [B·T] rows of x [B, T, C] (channels contiguous; batch and token strides free, so
a channel slice of a fused qkv projection is read in place). A program takes a [BT tokens, BD channels] tile; for
each row it knows its sequence n, its position p in it and the sequence's length L (`row_info`): from B and T, or
for a packed row (cu_seqlens, B = 1) from a per-token sequence index. A tap reading position p − k < 0 reads the
initial state's column W − 1 + p − k instead (zero without one), so no tap reaches into the previous sequence; the
host hands the kernels that state as rows [N, W − 1, C] (`state_rows`), so it is read like x, channels contiguous
(its [N, C, W − 1] layout read in place took a Hopper compile from ~100 to 255 registers with spills).

Why this shape: the op is memory-bound (W ≤ 8 multiply-adds per element), so the forward reads x once from DRAM
and writes y once; the W shifted loads of a tile overlap in L1. The per-token sequence index costs 4 bytes per token
(≤ 0.1% of the traffic at C ≥ 2048) and needs no host sync, where per-sequence block lists would.

The same kernels run on CPU tensors under TRITON_INTERPRET=1 (how CI tests them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rltrain_kernels.ops.common.rows import row_info, row_offset

# Tile of the forward kernel: (BT tokens, BD channels, warps). Registers per thread, Triton 3.6 for sm_90, bf16
# W = 4 with SiLU, without / with an initial state: 16×128×4 70 / 100, 32×128×4 104 / 174; H200, B4 T4096 C8192:
# 32×128×4 198 µs, 16×128×4 210. (The backward's tile is kernel_bwd.BACKWARD_TILE.) bench_short_conv.py --sweep.
FORWARD_TILE = (32, 128, 4)
BLOCK_D = 128  # the small kernels' channels per program (final state, state gradients)
# Decode step: (channels per program, warps). H200, B64 C8192 W4 bf16 [B, C, W] cache: 256×2 3.02 µs, 128×4 3.58,
# 64×2 6.02; fla 0.6's autotuned kernel 3.06 (.diag-style sweep, interleaved rounds).
DECODE_TILE = (256, 2)
# Widest kernel the kernels take (the kernels unroll W shifted loads of x).
MAX_WIDTH = 8
ACTIVATIONS = (None, "silu", "swish")


@triton.jit
def load_tap(x, x_off, stride_xt, k: tl.constexpr, p, n, live, state, C, cols, col_mask,
             HAS_STATE: tl.constexpr, W: tl.constexpr):
    """[BT, BD] fp32 input at position p + k of each row (k < 0 reads earlier tokens): x where p + k ≥ 0, else row
    W − 1 + p + k of sequence n's state ([N, W − 1, C] rows), 0 where `live` is false."""
    q = p + k
    v = tl.load(x + (x_off + k * stride_xt)[:, None] + cols[None, :],
                mask=(live & (q >= 0))[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
    if HAS_STATE:
        if k < 0:
            s_off = (n.to(tl.int64) * (W - 1) + (W - 1 + q)) * C
            v += tl.load(state + s_off[:, None] + cols[None, :],
                         mask=(live & (q < 0))[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
    return v


@triton.jit
def _short_conv_fwd_kernel(
    x, stride_xb, stride_xt,
    weight, bias,
    residual, stride_rb, stride_rt,
    state,
    seq_ids, cu_seqlens,
    y,
    n_rows, T, C,
    W: tl.constexpr,
    SILU: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_STATE: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    BT: tl.constexpr,
    BD: tl.constexpr,
):
    i_d, i_t = tl.program_id(0), tl.program_id(1)
    cols = i_d * BD + tl.arange(0, BD)
    col_mask = cols < C
    g = i_t * BT + tl.arange(0, BT)
    valid, n, p, L, b, t = row_info(g, n_rows, T, seq_ids, cu_seqlens, IS_VARLEN)
    x_off = row_offset(b, t, stride_xb, stride_xt)
    acc = tl.zeros([BT, BD], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    for w in tl.static_range(W):
        w_tap = tl.load(weight + cols * W + w, mask=col_mask, other=0.0).to(tl.float32)
        acc += w_tap[None, :] * load_tap(x, x_off, stride_xt, w - (W - 1), p, n, valid, state, C, cols,
                                         col_mask, HAS_STATE, W)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    mask = valid[:, None] & col_mask[None, :]
    if HAS_RESIDUAL:
        r_off = row_offset(b, t, stride_rb, stride_rt)
        acc += tl.load(residual + r_off[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(y + g.to(tl.int64)[:, None] * C + cols[None, :], acc.to(y.dtype.element_ty), mask=mask)


@triton.jit
def _final_state_kernel(
    x, stride_xb, stride_xt,
    state,
    cu_seqlens,
    final,
    T, C,
    W: tl.constexpr,
    HAS_STATE: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    BJ: tl.constexpr,
    BD: tl.constexpr,
):
    """final[n, :, j] = xx[L − (W − 1) + j] for the W − 1 columns j: the sequence's last inputs, or (for a sequence
    shorter than W − 1) the initial state's columns that are still in the window."""
    i_d, i_n = tl.program_id(0), tl.program_id(1)
    cols = i_d * BD + tl.arange(0, BD)
    col_mask = cols < C
    j = tl.arange(0, BJ)
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int32)
        L = tl.load(cu_seqlens + i_n + 1).to(tl.int32) - bos
        q = L - (W - 1) + j
        x_off = (bos + q).to(tl.int64) * stride_xt
    else:
        L = T
        q = L - (W - 1) + j
        x_off = i_n.to(tl.int64) * stride_xb + q.to(tl.int64) * stride_xt
    in_window = j < W - 1
    v = tl.load(x + x_off[:, None] + cols[None, :],
                mask=(in_window & (q >= 0))[:, None] & col_mask[None, :], other=0.0)
    if HAS_STATE:
        v += tl.load(state + (i_n.to(tl.int64) * (W - 1) + (W - 1 + q))[:, None] * C + cols[None, :],
                     mask=(in_window & (q < 0))[:, None] & col_mask[None, :], other=0.0).to(v.dtype)
    tl.store(final + i_n.to(tl.int64) * C * (W - 1) + cols[None, :] * (W - 1) + j[:, None],
             v.to(final.dtype.element_ty), mask=in_window[:, None] & col_mask[None, :])


@triton.jit
def _update_kernel(
    x, state, weight, bias, y,
    C: tl.constexpr, S: tl.constexpr,
    STRIDE_XB: tl.constexpr, STRIDE_SB: tl.constexpr, STRIDE_SC: tl.constexpr, STRIDE_SS: tl.constexpr,
    W: tl.constexpr,
    SILU: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BS: tl.constexpr,
    BD: tl.constexpr,
):
    """One decode step for BD channels of sequence i_b: the state (S columns) shifts left by one and takes x last, in
    place; y = act(bias + Σ_w weight[:, w] · window[w]), the window being the new state's last W columns (when
    S = W − 1, the old column 0 then the new state). Shapes and strides are constexprs: with them the compiler knows
    each channel's state row is S contiguous values and loads and stores it whole (a decode loop keeps them fixed;
    the batch is the grid's and varies freely)."""
    i_d, i_b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    cols = i_d * BD + tl.arange(0, BD)
    col_mask = cols < C
    s = tl.arange(0, BS)
    x_row = tl.load(x + i_b * STRIDE_XB + cols, mask=col_mask, other=0.0)
    row = state + i_b * STRIDE_SB + cols.to(tl.int64) * STRIDE_SC
    new = tl.load(row[:, None] + ((s + 1) * STRIDE_SS)[None, :], mask=col_mask[:, None] & (s + 1 < S)[None, :],
                  other=0.0)
    new = tl.where((s == S - 1)[None, :], x_row.to(new.dtype)[:, None], new)
    tap = s - (S - W)  # the weight column that multiplies the new state's column s
    taps = tl.load(weight + cols[:, None] * W + tap[None, :],
                   mask=col_mask[:, None] & ((tap >= 0) & (s < S))[None, :], other=0.0)
    acc = tl.sum(taps.to(tl.float32) * new.to(tl.float32), axis=1)
    if S < W:  # S = W − 1: the window starts at the old column 0, which the shift drops
        acc += (tl.load(weight + cols * W, mask=col_mask, other=0.0).to(tl.float32)
                * tl.load(row, mask=col_mask, other=0.0).to(tl.float32))
    if HAS_BIAS:
        acc += tl.load(bias + cols, mask=col_mask, other=0.0).to(tl.float32)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y + i_b * C + cols, acc.to(y.dtype.element_ty), mask=col_mask)
    # every thread has read the columns it shifts before any thread overwrites them
    tl.debug_barrier()
    tl.store(row[:, None] + (s * STRIDE_SS)[None, :], new.to(state.dtype.element_ty),
             mask=col_mask[:, None] & (s < S)[None, :])


def state_rows(initial_state: torch.Tensor | None, W: int) -> torch.Tensor | None:
    """The last W − 1 columns of an initial state [N, C, S ≥ W − 1] as contiguous rows [N, W − 1, C]: the inputs
    before each sequence in x's layout, so the kernels read them as they read x (a copy of N·C·(W − 1) values)."""
    if initial_state is None:
        return None
    return initial_state[..., initial_state.shape[-1] - (W - 1):].transpose(1, 2).contiguous()


def short_conv_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       residual: torch.Tensor | None, initial_state: torch.Tensor | None, output_final_state: bool,
                       activation: str | None, cu_seqlens: torch.Tensor | None, seq_ids: torch.Tensor | None,
                       num_sequences: int, tile: tuple[int, int, int] | None = None):
    """(y [B, T, C] contiguous in x's dtype, final state [N, C, W − 1] in x's dtype or None). x's channel stride is
    1 (channel_rows); weight [C, W] contiguous; seq_ids from sequence_ids when packed; tile overrides
    FORWARD_TILE."""
    block_t, block_d, num_warps = tile or FORWARD_TILE
    B, T, C = x.shape
    W = weight.shape[1]
    n_rows = B * T
    y = torch.empty((B, T, C), dtype=x.dtype, device=x.device)
    state = state_rows(initial_state, W)
    block_d = min(block_d, triton.next_power_of_2(C))
    if n_rows > 0:
        res_args = (residual, residual.stride(0), residual.stride(1)) if residual is not None else (x, 0, 0)
        grid = (triton.cdiv(C, block_d), triton.cdiv(n_rows, block_t))
        _short_conv_fwd_kernel[grid](
            x, x.stride(0), x.stride(1),
            weight, bias if bias is not None else weight,
            *res_args,
            state if state is not None else x,
            seq_ids if seq_ids is not None else x, cu_seqlens if cu_seqlens is not None else x,
            y,
            n_rows, T, C,
            W=W, SILU=activation is not None, HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
            HAS_STATE=state is not None, IS_VARLEN=cu_seqlens is not None,
            BT=block_t, BD=block_d, num_warps=num_warps,
        )
    final = None
    if output_final_state:
        final = torch.empty((num_sequences, C, W - 1), dtype=x.dtype, device=x.device)
        if num_sequences > 0:
            BD = min(BLOCK_D, triton.next_power_of_2(C))
            _final_state_kernel[(triton.cdiv(C, BD), num_sequences)](
                x, x.stride(0), x.stride(1),
                state if state is not None else x,
                cu_seqlens if cu_seqlens is not None else x,
                final,
                T, C,
                W=W, HAS_STATE=state is not None, IS_VARLEN=cu_seqlens is not None,
                BJ=triton.next_power_of_2(W - 1), BD=BD,
            )
    return y, final


def short_conv_update_forward(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                              bias: torch.Tensor | None, activation: str | None) -> torch.Tensor:
    """One decode step: x [B, C] with unit channel stride, conv_state [B, C, S] updated in place; returns y [B, C]."""
    B, C = x.shape
    W, S = weight.shape[1], conv_state.shape[-1]
    y = torch.empty((B, C), dtype=x.dtype, device=x.device)
    if B == 0:
        return y
    BD, num_warps = DECODE_TILE
    BD = min(BD, triton.next_power_of_2(C))
    _update_kernel[(triton.cdiv(C, BD), B)](
        x, conv_state, weight, bias if bias is not None else weight, y,
        C, S, x.stride(0), *conv_state.stride(),
        W=W, SILU=activation is not None, HAS_BIAS=bias is not None,
        BS=triton.next_power_of_2(S), BD=BD, num_warps=num_warps,
    )
    return y
