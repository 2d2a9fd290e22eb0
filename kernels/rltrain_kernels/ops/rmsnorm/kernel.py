"""Fused RMSNorm (optionally with the pre-norm residual add) as Triton kernels: forward, backward, host functions.

Why a kernel: eager RMSNorm makes ~6 passes over the activation (upcast, square, mean, rsqrt-multiply, downcast,
weight-multiply) and keeps an fp32 copy for backward; the fused forward reads x (and residual) once and writes y
(and s = x + residual) once, saving only one fp32 rstd per row. The backward reads x, dy (and ds) once and writes
dx once, accumulating dw = Σ_rows dy·x̂ in fp32 registers of a persistent grid (Liger's scheme) and reducing the
small [programs, H] partial matrix afterwards.

Maths (x̂ = x·rstd, rstd = 1/sqrt(mean(x²) + eps), y = w·x̂):
    dx = rstd · (dy·w − x̂ · mean(dy·w·x̂)),   dw = Σ_rows dy·x̂,   d(residual) = dx (+ ds, the grad of s)

The same kernels run on CPU tensors under TRITON_INTERPRET=1 (how CI tests them), so nothing here touches
torch.cuda for a CPU tensor and the kernels stay within the common Triton subset (triton 3.6 and 3.9).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rltrain_kernels.ops.common.rows import as_rows

# Largest hidden size the one-tile-per-row kernels take (64K fp32 values per row tile already spills registers);
# larger rows go to the plain-PyTorch path in __init__.py.
MAX_FUSED_COLS = 65536
# Backward persistent grid: as many programs per SM as can be resident at once (from the compiled kernel's register
# count, as in Triton's fused-softmax tutorial), so the grid is exactly one wave. Each program keeps w and its dw
# partial in registers (2·H fp32) besides the rows it works on: ptxas (sm_90, triton 3.9) gives 128 registers per
# thread at H=4096 and 8 warps (101 without the loop's prefetch), i.e. 2 programs per SM; launching more would only
# add a half-empty second wave. The dw partials stay small (2·132·4096·4 B = 4.3 MB on an H100/H200 at H=4096, ~1% of
# the 384 MB the backward moves). BACKWARD_PROGRAMS_PER_SM is the fallback when the register count cannot be read;
# benchmarks may force a value through rms_norm_backward(programs_per_sm=...).
BACKWARD_PROGRAMS_PER_SM = 2
_RESIDENT_CACHE: dict[tuple, int] = {}
# Programs for the persistent backward grid on the CPU interpreter (no SMs; few programs = fast interpretation).
INTERPRETER_PROGRAMS = 4


def _launch_config(n_cols: int) -> tuple[int, int, int]:
    """(BLOCK_COLS, BLOCK_ROWS, num_warps): one row per program for H ≥ 2048 (Llama-size rows), several rows per
    program for narrow rows (e.g. Qwen3's per-head q/k norm, H=128: 16 rows per program) so a program always holds
    ≥ 2048 elements; num_warps 4/8/16 for tiles of ≤2048/≤8192/larger elements (8 warps at H=4096 give each thread
    16 bf16 values = two 16-byte vector loads)."""
    block_cols = triton.next_power_of_2(n_cols)
    block_rows = max(1, min(16, 2048 // block_cols))
    tile = block_cols * block_rows
    num_warps = 4 if tile <= 2048 else 8 if tile <= 8192 else 16
    return block_cols, block_rows, num_warps


@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr, x_row_stride,
    res_ptr, res_row_stride,
    s_ptr, s_row_stride,
    w_ptr,
    y_ptr, y_row_stride,
    rstd_ptr,
    n_rows, n_cols, eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_COLS)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & (cols[None, :] < n_cols)

    x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0)
    # the weight's load issued with x's, not after the reduction (where its latency would be exposed)
    w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + rows[:, None] * res_row_stride + cols[None, :], mask=mask, other=0.0)
        # Round s to the activation dtype before normalising, exactly as the eager `residual + hidden_states`.
        x = (x.to(tl.float32) + res.to(tl.float32)).to(s_ptr.dtype.element_ty)
        tl.store(s_ptr + rows[:, None] * s_row_stride + cols[None, :], x, mask=mask)
    x = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    y = x * rstd[:, None] * w[None, :]
    tl.store(y_ptr + rows[:, None] * y_row_stride + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)


@triton.jit
def _rms_norm_bwd_kernel(
    dy_ptr, dy_row_stride,
    x_ptr, x_row_stride,
    w_ptr, rstd_ptr,
    ds_ptr, ds_row_stride,
    dx_ptr, dx_row_stride,
    dw_partial_ptr,
    n_rows, n_cols, num_programs,
    HAS_DS: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    pid = tl.program_id(0)
    pid64 = pid.to(tl.int64)
    cols = tl.arange(0, BLOCK_COLS)
    col_mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK_COLS], dtype=tl.float32)
    n_blocks = tl.cdiv(n_rows, BLOCK_ROWS)
    # Software pipelining by hand: the loads of the next row block are issued before this block's maths and stores,
    # so each program keeps two blocks of dy/x in flight. Only ~2 programs fit per SM at H=4096 (~100-120 registers
    # per thread at 8 warps, ptxas for sm_90), so without it an SM has at most 32 KB of loads outstanding, below what
    # its share of HBM bandwidth needs to cover the latency.
    first = pid64 * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    first_mask = (first < n_rows)[:, None] & col_mask[None, :]
    dy_next = tl.load(dy_ptr + first[:, None] * dy_row_stride + cols[None, :], mask=first_mask, other=0.0)
    x_next = tl.load(x_ptr + first[:, None] * x_row_stride + cols[None, :], mask=first_mask, other=0.0)
    rstd_next = tl.load(rstd_ptr + first, mask=first < n_rows, other=0.0)
    # Persistent loop: program p takes row blocks p, p + P, p + 2P, ... and keeps its dw partial in registers.
    for block in range(pid, n_blocks, num_programs):
        # 64-bit row index (the interpreter hands `block` over as a Python int, hence the pid64 detour).
        rows = (pid64 + (block - pid)) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        dy = dy_next.to(tl.float32)
        x = x_next.to(tl.float32)
        rstd = rstd_next
        nxt = rows + num_programs * BLOCK_ROWS
        nxt_mask = (nxt < n_rows)[:, None] & col_mask[None, :]
        dy_next = tl.load(dy_ptr + nxt[:, None] * dy_row_stride + cols[None, :], mask=nxt_mask, other=0.0)
        x_next = tl.load(x_ptr + nxt[:, None] * x_row_stride + cols[None, :], mask=nxt_mask, other=0.0)
        rstd_next = tl.load(rstd_ptr + nxt, mask=nxt < n_rows, other=0.0)
        x_hat = x * rstd[:, None]
        wdy = dy * w[None, :]
        mean_wdy_xhat = tl.sum(wdy * x_hat, axis=1) / n_cols
        dx = (wdy - x_hat * mean_wdy_xhat[:, None]) * rstd[:, None]
        if HAS_DS:
            dx += tl.load(ds_ptr + rows[:, None] * ds_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + rows[:, None] * dx_row_stride + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if COMPUTE_DW:
            dw_acc += tl.sum(dy * x_hat, axis=0)
    if COMPUTE_DW:
        tl.store(dw_partial_ptr + pid64 * n_cols + cols, dw_acc, mask=col_mask)


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """Returns (y, normed, rstd, s): y like x; `normed` is the [rows, H] tensor that was normalised (a view of x,
    or of the new s = x + residual); rstd is fp32 [rows]; s is None without a residual."""
    n_cols = x.shape[-1]
    x_rows = as_rows(x, n_cols)
    n_rows = x_rows.shape[0]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y_rows = y.view(-1, n_cols)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    if residual is not None:
        res_rows = as_rows(residual, n_cols)
        s = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        s_rows = s.view(-1, n_cols)
    else:
        s = None
        res_rows = s_rows = x_rows  # unused placeholders (HAS_RESIDUAL=False)
    if n_rows == 0:
        return y, s_rows, rstd, s
    block_cols, block_rows, num_warps = _launch_config(n_cols)
    grid = (triton.cdiv(n_rows, block_rows),)
    _rms_norm_fwd_kernel[grid](
        x_rows, x_rows.stride(0),
        res_rows, res_rows.stride(0),
        s_rows, s_rows.stride(0),
        weight,
        y_rows, y_rows.stride(0),
        rstd,
        n_rows, n_cols, eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols,
        num_warps=num_warps,
    )
    return y, s_rows, rstd, s


def _resident_programs_per_sm(warmup, key: tuple, device: torch.device, num_warps: int) -> int:
    """How many programs of the compiled backward kernel fit on one SM (registers and threads), cached per config;
    `warmup()` compiles the kernel without launching it and returns Triton's CompiledKernel."""
    if key not in _RESIDENT_CACHE:
        try:
            compiled = warmup()
            compiled._init_handles()  # loads the binary; fills n_regs (triton 3.x)
            props = torch.cuda.get_device_properties(device)
            regs_per_sm = getattr(props, "regs_per_multiprocessor", 65536)
            regs_per_warp = -(-compiled.n_regs * 32 // 256) * 256  # registers are allocated per warp, 256 at a time
            by_regs = regs_per_sm // (regs_per_warp * num_warps)
            by_threads = getattr(props, "max_threads_per_multi_processor", 2048) // (32 * num_warps)
            _RESIDENT_CACHE[key] = max(1, min(by_regs, by_threads))
        except Exception:  # noqa: BLE001 - a Triton internals change must not break training, only tuning
            _RESIDENT_CACHE[key] = BACKWARD_PROGRAMS_PER_SM
    return _RESIDENT_CACHE[key]


def rms_norm_backward(dy: torch.Tensor | None, normed: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                      ds: torch.Tensor | None = None, compute_dw: bool = True,
                      programs_per_sm: int | None = None,
                      num_warps: int | None = None):
    """Gradients (dx, dw) from the saved `normed` [rows, H] rows and rstd. dy and ds (the gradient reaching the
    residual sum s directly) may have any strides or be None (output unused). dx has dy's shape (ds's when dy is
    None); dx is also the residual's gradient. dw is None when compute_dw is False. programs_per_sm=None sizes the
    persistent grid to one full wave of resident programs; num_warps overrides the forward's choice (tuning only)."""
    n_rows, n_cols = normed.shape
    shape = dy.shape if dy is not None else ds.shape
    if dy is None:  # y did not reach the loss: dx = ds, dw = 0
        dx = ds.to(normed.dtype) if ds is not None else torch.zeros(shape, dtype=normed.dtype, device=normed.device)
        return dx, (torch.zeros_like(weight) if compute_dw else None)
    dy_rows = as_rows(dy, n_cols)
    ds_rows = as_rows(ds, n_cols) if ds is not None else dy_rows
    dx = torch.empty(shape, dtype=normed.dtype, device=normed.device)
    dx_rows = dx.view(-1, n_cols)
    block_cols, block_rows, default_warps = _launch_config(n_cols)
    num_warps = num_warps or default_warps
    n_blocks = triton.cdiv(n_rows, block_rows)
    device = normed.device
    dw_partial = torch.empty((1,), dtype=torch.float32, device=device)  # placeholder until the grid is known

    def launch(programs: int, warmup: bool = False):
        kernel = _rms_norm_bwd_kernel.warmup if warmup else _rms_norm_bwd_kernel[(programs,)]
        extra = {"grid": (1,)} if warmup else {}
        return kernel(
            dy_rows, dy_rows.stride(0),
            normed, normed.stride(0),
            weight, rstd,
            ds_rows, ds_rows.stride(0),
            dx_rows, dx_rows.stride(0),
            dw_partial,
            n_rows, n_cols, programs,
            HAS_DS=ds is not None, COMPUTE_DW=compute_dw,
            BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols,
            num_warps=num_warps, **extra,
        )

    if device.type == "cuda":
        sm_count = torch.cuda.get_device_properties(device).multi_processor_count
        if programs_per_sm is None:
            key = (device.index, block_cols, block_rows, num_warps, ds is not None, compute_dw,
                   normed.dtype, dy_rows.dtype, weight.dtype)
            # Warm up with a grid-size argument like the real one (Triton specialises ints equal to 1 or ≡ 0 mod 16).
            programs_per_sm = _resident_programs_per_sm(
                lambda: launch(sm_count * BACKWARD_PROGRAMS_PER_SM, warmup=True), key, device, num_warps)
        programs = max(1, min(n_blocks, sm_count * programs_per_sm))
    else:
        programs = max(1, min(n_blocks, INTERPRETER_PROGRAMS))
    if compute_dw:
        dw_partial = torch.empty((programs, n_cols), dtype=torch.float32, device=device)
    if n_rows > 0:
        launch(programs)
    elif compute_dw:
        dw_partial.zero_()
    dw = dw_partial.sum(dim=0).to(weight.dtype) if compute_dw else None
    return dx, dw
