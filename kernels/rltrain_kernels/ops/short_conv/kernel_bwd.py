"""The short convolution's backward Triton kernels and host function: gradients for x, weight, bias and the initial
state, with the SiLU's pre-activation recomputed from x instead of saved.

Maths, per sequence (xx = [state, x], z = bias + Σ_w weight[w] · xx[p − (W − 1) + w], y = act(z), dz = dy · act'(z)):

    dx[p]      = Σ_s weight[W − 1 − s] · dz[p + s]          (s = 0 .. W − 1, p + s < L)   (+ d final[p − L + W − 1])
    dweight[w] = Σ_p dz[p + W − 1 − w] · x[p]                (real inputs; the state's part below)
               + Σ_i dz[i − w] · state[i]                    (state column i = 0 .. W − 2, 0 ≤ i − w < L)
    dbias      = Σ_p dz[p]
    dstate[i]  = Σ_w weight[w] · dz[i − w]                                                (+ d final[i − L], i ≥ L)

The main kernel recomputes z from x (nothing but x is saved for backward): a block of BT rows computes dz once per
row (W shifted loads of x, one of dy, one sigmoid per element) and reads it back at the W shifts with `tl.gather`
(through shared memory), so it yields dx for its first BT − (W − 1) rows and blocks overlap by W − 1 rows (2.4% of
the rows recomputed at BT = 128, W = 4). No block depends on another: no scratch, no barrier between blocks. A
fwd+bwd thus reads x twice and dy once from DRAM and writes y and dx once; no z or dz goes through DRAM (fla's
backward runs the convolution again to materialise z, then reads it W times). Each program sums its blocks'
dweight/dbias in registers; the host sums the [programs, C, W] partials. A second, small kernel handles what
touches the initial state (first W − 1 positions of each sequence).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rltrain_kernels.ops.common.rows import row_info, row_offset

from .kernel import BLOCK_D, load_tap, state_rows

# Tile of the main backward kernel: (BT tokens, BD channels, warps); BT ≥ 2W (raised where smaller). H200, B4 T4096
# C8192 W4 SiLU, backward alone: 128×64×8 1005 µs, 64×64×4 1087, 32×128×4 1452 (bench_short_conv.py --sweep).
BACKWARD_TILE = (128, 64, 8)
# Programs per SM of the backward grid (channel blocks × token groups): each program walks a run of token blocks
# and keeps one [W, BD] dweight partial ([groups, C, W] fp32 for the host to sum): fewer programs, fewer partials;
# more programs, a shorter tail. H200: 8 1082 µs fwd+bwd, 16 1064.
PROGRAMS_PER_SM = 16
# Token groups under the CPU interpreter: 2, so the tests cover a program walking several blocks and a partial sum.
INTERPRETER_GROUPS = 2


@triton.jit
def _dz(x, x_off, stride_xt, dy, dy_off, p, n, live, weight, bias, state, C, cols, col_mask, W: tl.constexpr,
        SILU: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_STATE: tl.constexpr):
    """dz = dy · act'(z) at each row ([BT, BD] fp32, 0 where `live` is false); z recomputed from x."""
    dys = tl.load(dy + dy_off[:, None] + cols[None, :],
                  mask=live[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
    if SILU:
        z = tl.zeros_like(dys)
        if HAS_BIAS:
            z += tl.load(bias + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        for w in tl.static_range(W):
            w_tap = tl.load(weight + cols * W + w, mask=col_mask, other=0.0).to(tl.float32)
            z += w_tap[None, :] * load_tap(x, x_off, stride_xt, w - (W - 1), p, n, live, state, C, cols,
                                           col_mask, HAS_STATE, W)
        sig = tl.sigmoid(z)
        dys = dys * sig * (1.0 + z * (1.0 - sig))
    return dys


@triton.jit
def _short_conv_bwd_kernel(
    x, stride_xb, stride_xt,
    dy, stride_dyb, stride_dyt,
    weight, bias,
    state,
    dfinal,
    seq_ids, cu_seqlens,
    dx, dw_partial, db_partial,
    n_rows, T, C, n_blocks, blocks_per_program,
    W: tl.constexpr,
    SILU: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_STATE: tl.constexpr,
    HAS_DFINAL: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    COMPUTE_DB: tl.constexpr,
    BT: tl.constexpr,
    BD: tl.constexpr,
    BW: tl.constexpr,
):
    i_d, i_g = tl.program_id(0), tl.program_id(1)
    cols = i_d * BD + tl.arange(0, BD)
    col_mask = cols < C
    rows = tl.arange(0, BT)
    taps = tl.arange(0, BW)
    first = i_g * blocks_per_program
    last = tl.minimum(first + blocks_per_program, n_blocks)
    S: tl.constexpr = BT - (W - 1)  # block stride: the tile's last W − 1 rows only feed the rows before them
    out = rows < S
    dw_acc = tl.zeros([BW, BD], dtype=tl.float32)
    db_acc = tl.zeros([BD], dtype=tl.float32)
    for blk in range(first, last):  # independent blocks: only the dweight/dbias sums carry over
        g = blk * S + rows
        valid, n, p, L, b, t = row_info(g, n_rows, T, seq_ids, cu_seqlens, IS_VARLEN)
        x_off = row_offset(b, t, stride_xb, stride_xt)
        dz = _dz(x, x_off, stride_xt, dy, row_offset(b, t, stride_dyb, stride_dyt), p, n, valid, weight, bias,
                 state, C, cols, col_mask, W, SILU, HAS_BIAS, HAS_STATE)
        mask = (valid & out)[:, None] & col_mask[None, :]
        if COMPUTE_DW:
            x0 = tl.load(x + x_off[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dx_acc = tl.zeros([BT, BD], dtype=tl.float32)
        for s in tl.static_range(W):
            if s == 0:
                dzs = tl.where(out[:, None], dz, 0.0)
            else:  # dz at p + s: row r + s of the tile, 0 past the sequence's end
                shifted = tl.gather(dz, tl.broadcast_to(tl.minimum(rows + s, BT - 1)[:, None], [BT, BD]), 0)
                dzs = tl.where((out & (p + s < L))[:, None], shifted, 0.0)
            w_tap = tl.load(weight + cols * W + (W - 1 - s), mask=col_mask, other=0.0).to(tl.float32)
            dx_acc += w_tap[None, :] * dzs
            if COMPUTE_DW:
                dw_acc += tl.where((taps == W - 1 - s)[:, None], tl.sum(dzs * x0, 0)[None, :], 0.0)
            if COMPUTE_DB:
                if s == 0:
                    db_acc += tl.sum(dzs, 0)
        if HAS_DFINAL:
            j = p - L + (W - 1)  # the final-state column this input became
            dx_acc += tl.load(dfinal + (n.to(tl.int64) * C)[:, None] * (W - 1) + cols[None, :] * (W - 1)
                              + j[:, None], mask=(valid & out & (j >= 0))[:, None] & col_mask[None, :],
                              other=0.0).to(tl.float32)
        tl.store(dx + g.to(tl.int64)[:, None] * C + cols[None, :], dx_acc.to(dx.dtype.element_ty), mask=mask)
    if COMPUTE_DW:
        tl.store(dw_partial + i_g.to(tl.int64) * C * W + cols[None, :] * W + taps[:, None], dw_acc,
                 mask=(taps < W)[:, None] & col_mask[None, :])
    if COMPUTE_DB:
        tl.store(db_partial + i_g.to(tl.int64) * C + cols, db_acc, mask=col_mask)


@triton.jit
def _state_bwd_kernel(
    x, stride_xb, stride_xt,
    dy, stride_dyb, stride_dyt,
    weight, bias,
    state,
    dfinal,
    cu_seqlens,
    dstate, dw_state,
    T, C,
    W: tl.constexpr,
    SILU: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_DFINAL: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    BJ: tl.constexpr,
    BD: tl.constexpr,
    BW: tl.constexpr,
):
    """Sequence i_n, BD channels: dstate [W − 1 columns] and the state's part of dweight (a per-sequence partial)."""
    i_d, i_n = tl.program_id(0), tl.program_id(1)
    cols = i_d * BD + tl.arange(0, BD)
    col_mask = cols < C
    j = tl.arange(0, BJ)  # state column
    in_window = j < W - 1
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int32)
        L = tl.load(cu_seqlens + i_n + 1).to(tl.int32) - bos
        b = tl.zeros_like(j)
    else:
        bos = 0
        L = T
        b = tl.zeros_like(j) + i_n
    n = tl.zeros_like(j) + i_n
    st = tl.load(state + (i_n.to(tl.int64) * (W - 1) + j)[:, None] * C + cols[None, :],
                 mask=in_window[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
    taps = tl.arange(0, BW)
    dst = tl.zeros([BJ, BD], dtype=tl.float32)
    dw_acc = tl.zeros([BW, BD], dtype=tl.float32)
    for w in tl.static_range(W):
        # tap w of the output at position p = j − w reads state column j
        p = j - w
        live = in_window & (p >= 0) & (p < L)
        row = bos + p
        x_off = row_offset(b, row, stride_xb, stride_xt)
        dy_off = row_offset(b, row, stride_dyb, stride_dyt)
        dz = _dz(x, x_off, stride_xt, dy, dy_off, p, n, live, weight, bias, state, C, cols, col_mask, W, SILU,
                 HAS_BIAS, True)
        w_tap = tl.load(weight + cols * W + w, mask=col_mask, other=0.0).to(tl.float32)
        dst += w_tap[None, :] * dz
        if COMPUTE_DW:
            dw_acc += tl.where((taps == w)[:, None], tl.sum(dz * st, 0)[None, :], 0.0)
    if HAS_DFINAL:
        # a sequence shorter than W − 1 passes state column j on to final-state column j − L
        jf = j - L
        dst += tl.load(dfinal + i_n.to(tl.int64) * C * (W - 1) + cols[None, :] * (W - 1) + jf[:, None],
                       mask=(in_window & (jf >= 0))[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
    tl.store(dstate + i_n.to(tl.int64) * C * (W - 1) + cols[None, :] * (W - 1) + j[:, None], dst,
             mask=in_window[:, None] & col_mask[None, :])
    if COMPUTE_DW:
        tl.store(dw_state + i_n.to(tl.int64) * C * W + cols[None, :] * W + taps[:, None], dw_acc,
                 mask=(taps < W)[:, None] & col_mask[None, :])


def _token_groups(n_blocks: int, channel_blocks: int, device: torch.device, programs_per_sm: int) -> int:
    if device.type != "cuda":
        return max(1, min(n_blocks, INTERPRETER_GROUPS))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(n_blocks, triton.cdiv(programs_per_sm * sms, channel_blocks)))


def short_conv_backward(dy: torch.Tensor, dfinal: torch.Tensor | None, x: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor | None, initial_state: torch.Tensor | None, activation: str | None,
                        cu_seqlens: torch.Tensor | None, seq_ids: torch.Tensor | None, num_sequences: int,
                        compute_dw: bool, compute_db: bool, compute_dstate: bool,
                        tile: tuple[int, int, int] | None = None, programs_per_sm: int = PROGRAMS_PER_SM):
    """(dx [B, T, C] in x's dtype, dweight [C, W] fp32 or None, dbias [C] fp32 or None, dstate [N, C, W − 1] fp32
    or None). dy has x's shape with unit channel stride (any batch/token strides); dfinal [N, C, W − 1] or None;
    tile overrides BACKWARD_TILE and programs_per_sm PROGRAMS_PER_SM (tuning sweeps: bench_short_conv.py)."""
    block_t, block_d, num_warps = tile or BACKWARD_TILE
    B, T, C = x.shape
    W = weight.shape[1]
    n_rows = B * T
    device = x.device
    state = state_rows(initial_state, W)
    dfinal = dfinal.contiguous() if dfinal is not None else None
    block_d = min(block_d, triton.next_power_of_2(C))
    channel_blocks = triton.cdiv(C, block_d)
    block_t = max(block_t, triton.next_power_of_2(2 * W))  # a block yields BT − (W − 1) rows of dx
    n_blocks = triton.cdiv(n_rows, block_t - (W - 1))
    groups = _token_groups(n_blocks, channel_blocks, device, programs_per_sm)
    per_program = triton.cdiv(n_blocks, groups) if n_blocks else 0
    groups = triton.cdiv(n_blocks, per_program) if n_blocks else 1
    bw = triton.next_power_of_2(W)
    dx = torch.empty((B, T, C), dtype=x.dtype, device=device)
    dw_partial = torch.empty((groups, C, W), dtype=torch.float32, device=device) if compute_dw else None
    db_partial = torch.empty((groups, C), dtype=torch.float32, device=device) if compute_db else None
    common = dict(W=W, SILU=activation is not None, HAS_BIAS=bias is not None, HAS_DFINAL=dfinal is not None,
                  IS_VARLEN=cu_seqlens is not None, COMPUTE_DW=compute_dw)
    if n_rows > 0:
        _short_conv_bwd_kernel[(channel_blocks, groups)](
            x, x.stride(0), x.stride(1),
            dy, dy.stride(0), dy.stride(1),
            weight, bias if bias is not None else weight,
            state if state is not None else x,
            dfinal if dfinal is not None else x,
            seq_ids if seq_ids is not None else x, cu_seqlens if cu_seqlens is not None else x,
            dx, dw_partial if compute_dw else x, db_partial if compute_db else x,
            n_rows, T, C, n_blocks, per_program,
            HAS_STATE=state is not None, COMPUTE_DB=compute_db,
            BT=block_t, BD=block_d, BW=bw, num_warps=num_warps, **common,
        )
    else:
        for partial in (dw_partial, db_partial):
            if partial is not None:
                partial.zero_()
    dw = dw_partial.sum(0) if compute_dw else None
    db = db_partial.sum(0) if compute_db else None
    dstate = None
    if state is not None and (compute_dstate or compute_dw):
        dstate = torch.empty((num_sequences, C, W - 1), dtype=torch.float32, device=device)
        dw_state = torch.empty((num_sequences, C, W), dtype=torch.float32, device=device) if compute_dw else None
        if num_sequences > 0:
            BD = min(BLOCK_D, triton.next_power_of_2(C))
            _state_bwd_kernel[(triton.cdiv(C, BD), num_sequences)](
                x, x.stride(0), x.stride(1),
                dy, dy.stride(0), dy.stride(1),
                weight, bias if bias is not None else weight,
                state if state is not None else x,
                dfinal if dfinal is not None else x,
                cu_seqlens if cu_seqlens is not None else x,
                dstate, dw_state if compute_dw else x,
                T, C,
                BJ=triton.next_power_of_2(W - 1), BD=BD, BW=triton.next_power_of_2(W), **common,
            )
            if compute_dw:
                dw = dw + dw_state.sum(0)
    return dx, dw, db, (dstate if compute_dstate else None)
