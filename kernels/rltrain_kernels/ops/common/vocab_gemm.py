"""The persistent TMA GEMM of the LM-head ops (`linear_logprobs`, `policy_loss`) with the row passes in its epilogue:
their CUDA path for bf16/fp16 on sm_90+.

The cuBLAS path (vocab_tiles.GemmThenRowPass + row_pass.py) writes every fp32 logits tile to memory and reads it
back in a row pass. Here one Triton kernel computes [BLOCK_M, BLOCK_N] blocks of logits on the tensor cores
(operands through TMA descriptors; one program per SM walking the blocks in grouped order) and uses each block while
it is still in registers:

    statistics: `_gemm_stats_kernel` folds the block into per-row partial statistics of z = logits / T relative to
                the block's max (max, Σexp − 1, Σexp·(z − max): 12 B per row per block) and stores z[label] for the
                rows whose label falls in it; `_merge_partials_kernel` folds a row's partials into its running
                statistics (the same exact-count form as the row pass: the blocks at the max contribute their 1 as
                an integer count, so log1p(u) stays exact when one logit dominates);
    kept      : for the policy loss (which knows its loss in the forward and so needs no recompute), the stats
                kernel also stores the logits (STORE_Y, through TMA): y = z − block max in fp16, which
                policy_loss/shifted.py later turns into dlogits in place, or with SCALED e^(z − R) in bf16, R a
                per-row reference, which the gradient GEMMs take as it is (policy_loss/scaled.py).

The dlogits epilogues live with their op: linear_logprobs/fused.py recomputes the block in its backward and writes
dlogits (2 B per logit written, nothing read); policy_loss/shifted.py reads the kept y. Both build on
`logits_block`, `row_grad_terms` and row_pass.dlogits_of here.

So no fp32 logit ever reaches memory: H100, N=8192, V=151936, H=4096 bf16, against cuBLAS + row passes in the
same run: forward 18.0 → 16.1 ms, forward+backward 68.5 → 58.3 ms (kernels/benchmarks/RESULTS.md). Without an
epilogue the same GEMM runs at cuBLAS' speed (1.03× the floor). Triton 3.6's automatic warp specialization on Hopper
(`tl.range(warp_specialize=True)`) at 4 warps hangs, fails to compile or runs 8× slower; at 8 warps without flatten
it runs, but slower here (GemmConfig.warp_specialize, off).

fp32 inputs keep the cuBLAS path (tl.dot would run them as tf32); so do GPUs without TMA (before sm_90) and
operands TMA cannot address (rows not 16 B aligned). Runs on CPU tensors under TRITON_INTERPRET=1 with small
blocks, how CI tests it; there bf16 operands are upcast before tl.dot (the interpreter's bf16 dot is wrong).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from rltrain_kernels.ops.common.row_pass import merge_lanes
from rltrain_kernels.ops.common.vocab_tiles import GemmConfig
from rltrain_kernels.utils import triton_interpreted


@triton.jit
def _block_of(tile, num_m, num_n, GROUP_M: tl.constexpr):
    """Grouped order: GROUP_M row blocks sweep the columns together, so each weight block is read from DRAM once
    per group and the group's hidden rows stay in L2."""
    per_group = GROUP_M * num_n
    first_m = (tile // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    local = tile % per_group
    return first_m + local % size_m, local // size_m


@triton.jit
def logits_block(tile, a_desc, b_desc, n_rows, n_cols, hidden_size, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, UPCAST: tl.constexpr):
    """Block `tile` of the persistent loop: (acc, rows, cols, pid_m, pid_n) with acc fp32 [BLOCK_M, BLOCK_N] =
    hidden[rows] @ weight[cols].T; TMA fills rows, columns and K past the end with zeros."""
    pid_m, pid_n = _block_of(tile, tl.cdiv(n_rows, BLOCK_M), tl.cdiv(n_cols, BLOCK_N), GROUP_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for ki in range(tl.cdiv(hidden_size, BLOCK_K)):
        a = a_desc.load([pid_m * BLOCK_M, ki * BLOCK_K])
        b = b_desc.load([pid_n * BLOCK_N, ki * BLOCK_K])
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b.T, acc)
    return acc, pid_m * BLOCK_M + tl.arange(0, BLOCK_M), pid_n * BLOCK_N + tl.arange(0, BLOCK_N), pid_m, pid_n


@triton.jit
def label_in_block(labels_ptr, rows, row_ok, vocab_start, n_cols):
    """The label's column in this launch's vocabulary slice, −1 where it falls outside (int32 compares below)."""
    local = tl.load(labels_ptr + rows, mask=row_ok, other=-1) - vocab_start
    return tl.where((local >= 0) & (local < n_cols), local, -1).to(tl.int32)


# n_rows is never specialised: Triton turns an int argument equal to 1 into a constant, on which .to() fails (a
# one-row micro-batch raised a CompilationError on the GPU; the interpreter does not specialise, so CI missed it)
@triton.jit(do_not_specialize=["n_rows"])
def _gemm_stats_kernel(
    a_desc, b_desc, y_desc, y_ptr, stride_y, ref_ptr, run_ptr, labels_ptr, part_ptr, label_z_ptr,
    n_rows, n_cols, hidden_size, n_blocks, vocab_start, inv_temp,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr, WITH_ENTROPY: tl.constexpr, FLATTEN: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
    SUBTILE: tl.constexpr,
    STORE_Y: tl.constexpr, Y_TMA: tl.constexpr, SCALED: tl.constexpr, RUN_FLAG: tl.constexpr,
):
    """part [3, n_rows, n_blocks] for block j of row r: 0: max z, 1: Σ_{z<max} e^(z−max) + n_max − 1,
    2: Σ e^(z−max)·(z−max); label_z[r] = z[label] written by the block holding the label. STORE_Y: also keep
    the block's logits in y [n_rows, n_cols] (`_store_y`): y = z − the block's max in fp16, or with SCALED
    y = e^(z − ref[r]) in y's dtype. Y_TMA: through y_desc (blocks of [BLOCK_M, BLOCK_N / 2] with SUBTILE, else
    [BLOCK_M, BLOCK_N]; TMA drops what lies past the end), else plain masked stores at y_ptr (row stride
    stride_y). RUN_FLAG: the whole launch does nothing unless the int32 at run_ptr is non-zero (a recompute the
    GPU decides on, no host sync)."""
    plane = n_rows.to(tl.int64) * n_blocks
    n_tiles = tl.cdiv(n_rows, BLOCK_M) * tl.cdiv(n_cols, BLOCK_N)
    if RUN_FLAG:
        n_tiles = tl.where(tl.load(run_ptr) != 0, n_tiles, 0)
    for tile in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), flatten=FLATTEN,
                         warp_specialize=WARP_SPECIALIZE):
        acc, rows, cols, pid_m, pid_n = logits_block(tile, a_desc, b_desc, n_rows, n_cols, hidden_size, BLOCK_M,
                                                     BLOCK_N, BLOCK_K, GROUP_M, UPCAST)
        row_ok = rows < n_rows
        local = label_in_block(labels_ptr, rows, row_ok, vocab_start, n_cols)
        ref = tl.zeros((BLOCK_M,), dtype=tl.float32)
        if SCALED:
            ref = tl.load(ref_ptr + rows, mask=row_ok, other=0.0)
        if SUBTILE:
            # the block's two column halves one after the other: half the epilogue's registers live at once
            halves = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
            acc0, acc1 = tl.split(halves)
            first = pid_n * BLOCK_N + tl.arange(0, BLOCK_N // 2)     # cols, split as acc is
            max0, rest0, n0, t0, lab0 = _fold_block(acc0, first, n_cols, local, inv_temp)
            max1, rest1, n1, t1, lab1 = _fold_block(acc1, first + BLOCK_N // 2, n_cols, local, inv_temp)
            # merged as the lanes of the row pass: relative to the block's max, the halves at it count exactly
            block_max = tl.maximum(max0, max1)     # finite: the first half holds a column
            d0 = max0 - block_max
            d1 = tl.where(max1 == -float("inf"), 0.0, max1 - block_max)   # the second half may lie past the end
            a0 = tl.exp(d0)
            a1 = tl.where(max1 == -float("inf"), 0.0, tl.exp(d1))
            n_max = tl.where(d0 == 0.0, n0, 0.0) + tl.where(max1 == block_max, n1, 0.0)
            rest = (rest0 * a0 + tl.where(d0 == 0.0, 0.0, n0 * a0)
                    + rest1 * a1 + tl.where(max1 == block_max, 0.0, n1 * a1))
            sum_t = a0 * (t0 + d0 * (rest0 + n0)) + a1 * (t1 + d1 * (rest1 + n1))
            y_label = tl.where(local < pid_n * BLOCK_N + BLOCK_N // 2, lab0 + max0, lab1 + max1) - block_max
            if STORE_Y:
                _store_y(y_desc, y_ptr, stride_y, _kept(acc0, block_max, ref, inv_temp, SCALED), rows,
                         first, row_ok, n_cols, pid_m * BLOCK_M, pid_n * BLOCK_N, Y_TMA)
                _store_y(y_desc, y_ptr, stride_y, _kept(acc1, block_max, ref, inv_temp, SCALED), rows,
                         first + BLOCK_N // 2, row_ok, n_cols, pid_m * BLOCK_M, pid_n * BLOCK_N + BLOCK_N // 2, Y_TMA)
        else:
            block_max, rest, n_max, sum_t, y_label = _fold_block(acc, cols, n_cols, local, inv_temp)
            if STORE_Y:
                _store_y(y_desc, y_ptr, stride_y, _kept(acc, block_max, ref, inv_temp, SCALED), rows,
                         cols, row_ok, n_cols, pid_m * BLOCK_M, pid_n * BLOCK_N, Y_TMA)
        out = part_ptr + rows.to(tl.int64) * n_blocks + pid_n
        tl.store(out, block_max, mask=row_ok)
        tl.store(out + plane, rest + (n_max - 1.0), mask=row_ok)
        if WITH_ENTROPY:
            tl.store(out + 2 * plane, sum_t, mask=row_ok)
        inside = row_ok & (local >= pid_n * BLOCK_N) & (local < pid_n * BLOCK_N + BLOCK_N)
        # z[label] = (z − max) + max: exact when the label holds the max (a dominating label's logprob stays −u)
        tl.store(label_z_ptr + rows, y_label + block_max, mask=inside)


@triton.jit
def _kept(acc, block_max, ref, inv_temp, SCALED: tl.constexpr):
    """What the stats kernel keeps of a block part `acc` (fp32, stored by `_store_y`). Shifted: y = z − (the
    block's max of z), for fp16: ≤ 0, exact at the max, relative rounding 2⁻¹¹ (bf16: 2⁻⁸) where p = e^y·…
    matters; clamped at −60000 so it stays finite in fp16 (e^y is 0 there either way). SCALED: e^(z − ref) (ref:
    the row's reference, policy_loss/scaled.py), the exponent clamped at 88 so it stays finite in bf16 (a row
    with ref = +inf: 0). Taking it from the fold's e^(z − block max) instead (a multiply, not an exp, per logit)
    timed the same on H100 and spilled 80 B."""
    if SCALED:
        return tl.exp(tl.minimum(acc * inv_temp - ref[:, None], 88.0))
    return tl.maximum(acc * inv_temp - block_max[:, None], -60000.0)


@triton.jit
def _store_y(y_desc, y_ptr, stride_y, y, rows, cols, row_ok, n_cols, row0, col0, Y_TMA: tl.constexpr):
    """Store the block part y (columns `cols`, from col0) in y's dtype: through TMA or plain masked stores."""
    y = y.to(y_ptr.dtype.element_ty)
    if Y_TMA:
        y_desc.store([row0, col0], y)
    else:
        tl.store(y_ptr + rows.to(tl.int64)[:, None] * stride_y + cols[None, :], y,
                 mask=row_ok[:, None] & (cols < n_cols)[None, :])


@triton.jit
def _fold_block(acc, cols, n_cols, local, inv_temp):
    """Per-row (max z, Σ_{z<max} e^(z−max), count at the max, Σ e^(z−max)·(z−max), z[label] − max (0 where the
    label is elsewhere)) of one block of logits."""
    z = tl.where((cols < n_cols)[None, :], acc * inv_temp, -float("inf"))
    block_max = tl.max(z, axis=1)
    # −inf on the columns past the end (all of them in a half past the end, whose max is −inf: then 0 everywhere)
    y = z - tl.where(block_max == -float("inf"), 0.0, block_max)[:, None]
    y_label = tl.sum(tl.where(cols[None, :] == local[:, None], y, 0.0), axis=1)
    e = tl.exp(y)
    is_max = y == 0.0
    n_max = tl.sum(is_max.to(tl.float32), axis=1)
    rest = tl.sum(tl.where(is_max, 0.0, e), axis=1)
    sum_t = tl.sum(e * tl.where(e > 0.0, y, 0.0), axis=1)   # 0·(−inf) never forms
    return block_max, rest, n_max, sum_t, y_label


@triton.jit(do_not_specialize=["n_rows"])   # as _gemm_stats_kernel
def _merge_partials_kernel(part_ptr, n_rows, n_blocks, m_ptr, u_ptr, t_ptr, BLOCK: tl.constexpr,
                           WITH_ENTROPY: tl.constexpr):
    """Fold row r's partials into its running (m, u, t) in place, BLOCK partials at a time, as the row pass merges
    its lanes (row_pass.merge_lanes: the partials at the max contribute their 1 as an exact count)."""
    row = tl.program_id(0).to(tl.int64)
    plane = n_rows.to(tl.int64) * n_blocks
    base = part_ptr + row * n_blocks
    m = tl.load(m_ptr + row)
    u = tl.load(u_ptr + row)
    t = 0.0
    if WITH_ENTROPY:
        t = tl.load(t_ptr + row)
    for start in range(0, n_blocks, BLOCK):
        j = start + tl.arange(0, BLOCK)
        ok = j < n_blocks
        part_t = tl.zeros((BLOCK,), dtype=tl.float32)
        if WITH_ENTROPY:
            part_t = tl.load(base + 2 * plane + j, mask=ok, other=0.0)
        # past the end: the (−inf, −1, 0) of a lane that saw nothing
        m, u, t = merge_lanes(tl.load(base + j, mask=ok, other=-float("inf")),
                              tl.load(base + plane + j, mask=ok, other=-1.0), part_t, m, u, t, WITH_ENTROPY)
    if WITH_ENTROPY:
        tl.store(t_ptr + row, t)
    tl.store(u_ptr + row, u)
    tl.store(m_ptr + row, m)


@triton.jit
def row_grad_terms(rows, row_ok, labels_ptr, entropy_ptr, g_logprob_ptr, g_entropy_ptr, vocab_start, n_cols,
                   HAS_G_LOGPROB: tl.constexpr, HAS_G_ENTROPY: tl.constexpr):
    """Per-row (g_lp, c0 = g_lp + g_ent·H, g_ent, label column or −1) for row_pass.dlogits_of; 0 where unused."""
    g_lp = tl.zeros(rows.shape, dtype=tl.float32)
    g_ent = tl.zeros(rows.shape, dtype=tl.float32)
    local = tl.full(rows.shape, -1, tl.int32)
    if HAS_G_LOGPROB:
        g_lp = tl.load(g_logprob_ptr + rows, mask=row_ok, other=0.0)
        local = label_in_block(labels_ptr, rows, row_ok, vocab_start, n_cols)
    c0 = g_lp
    if HAS_G_ENTROPY:
        g_ent = tl.load(g_entropy_ptr + rows, mask=row_ok, other=0.0)
        c0 = g_lp + g_ent * tl.load(entropy_ptr + rows, mask=row_ok, other=0.0)
    return g_lp, c0, g_ent, local


@functools.lru_cache(maxsize=None)
def multiprocessors(device: torch.device) -> int:
    """The device's SM count: one persistent program each."""
    if device.type != "cuda":
        return 4   # the interpreter: a few programs, each walking several blocks
    return torch.cuda.get_device_properties(device).multi_processor_count


def tma_ready(*tensors: torch.Tensor) -> bool:
    """Whether TMA can address these 2-D operands: unit inner stride, 16 B aligned base and row stride."""
    for x in tensors:
        size = x.element_size()
        if x.dim() != 2 or x.stride(1) != 1 or (x.stride(0) * size) % 16 or x.data_ptr() % 16:
            return False
    return True


def _unsupported(hidden: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why this path cannot run on these 2-D operands (None: it can; CPU tensors count as the interpreter's)."""
    if hidden.dtype not in (torch.bfloat16, torch.float16):
        return (f"impl='fused' takes bfloat16 or float16 inputs (its tensor-core GEMM would run {hidden.dtype} as "
                f"tf32); got {hidden.dtype}")
    if hidden.is_cuda and torch.cuda.get_device_capability(hidden.device)[0] < 9:
        return "impl='fused' needs TMA (an sm_90+ GPU such as H100/H200)"
    if not tma_ready(hidden, weight):
        return (f"impl='fused' needs hidden and weight rows 16-byte aligned with unit inner stride (hidden size "
                f"{hidden.shape[-1]} must be a multiple of 8)")
    return None


def supports(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether impl="auto" takes this path: a CUDA GPU and operands `check_runnable` accepts."""
    return hidden.is_cuda and _unsupported(hidden, weight) is None


def check_runnable(hidden: torch.Tensor, weight: torch.Tensor) -> None:
    """For an explicit impl="fused": a ValueError saying why it cannot run, and the way out, if it cannot."""
    reason = _unsupported(hidden, weight)
    if reason is not None:
        raise ValueError(f"{reason}; use impl='auto' or 'triton'")


class FusedGemm:
    """Launches of the persistent GEMM at one GemmConfig (None: GemmConfig.default()): the statistics of
    hidden_t @ weight_v.T folded into running row statistics, optionally keeping the block's logits. The ops'
    tile / chunk backends wrap it: linear_logprobs/fused.FusedTiles, policy_loss/shifted.ShiftedChunkLogits."""

    def __init__(self, config: GemmConfig | None = None):
        self.config = config or GemmConfig.default()

    def n_blocks(self, cols: int) -> int:
        """Column blocks over `cols` columns: the partials hold 3 fp32 per row per block."""
        return triton.cdiv(cols, self.config.block_n)

    def partials(self, rows: int, cols: int, device) -> torch.Tensor:
        """The fp32 partial statistics of a [rows, cols] launch (12 B per row per block)."""
        return torch.empty(3 * rows * self.n_blocks(cols), dtype=torch.float32, device=device)

    def descriptors(self, hidden_t, weight_v):
        """TMA descriptors of the operands, in the blocks the kernels load."""
        g = self.config
        return (TensorDescriptor.from_tensor(hidden_t, [g.block_m, g.block_k]),
                TensorDescriptor.from_tensor(weight_v, [g.block_n, g.block_k]))

    def grid(self, rows, cols, device) -> tuple[int]:
        """One program per SM, fewer when there are fewer blocks."""
        blocks = triton.cdiv(rows, self.config.block_m) * triton.cdiv(cols, self.config.block_n)
        return (max(1, min(multiprocessors(device), blocks)),)

    def fold(self, hidden_t, weight_v, part, labels, vocab_start, inv_temp, m, u, t, label_z, *, y=None, ref=None,
             run=None, merge=True):
        """The stats kernel over hidden_t @ weight_v.T (weight_v: the vocabulary rows from vocab_start), its
        partials in `part` (at least `partials`' size) and z[label] in label_z; merge: then fold the partials into
        the running (m, u, t) (t None: no entropy). y: also keep the logits there (z − block max in fp16, or with
        ref [rows] e^(z − ref) in y's dtype); run: an int32 flag on the device, the launch doing nothing while it
        is 0 (a recompute the GPU decides on, no host sync)."""
        rows, cols = hidden_t.shape[0], weight_v.shape[0]
        n_blocks = self.n_blocks(cols)
        part = part[: 3 * rows * n_blocks]
        g = self.config
        a_desc, b_desc = self.descriptors(hidden_t, weight_v)
        y_desc = None if y is None or not g.y_tma else TensorDescriptor.from_tensor(
            y, [g.block_m, g.block_n // 2 if g.subtile else g.block_n])
        _gemm_stats_kernel[self.grid(rows, cols, hidden_t.device)](
            a_desc, b_desc, y_desc, y, 0 if y is None else y.stride(0), ref, run, labels, part, label_z, rows, cols,
            hidden_t.shape[1], n_blocks, vocab_start, inv_temp,
            BLOCK_M=g.block_m, BLOCK_N=g.block_n, BLOCK_K=g.block_k, GROUP_M=g.group_m, UPCAST=triton_interpreted(),
            WITH_ENTROPY=t is not None, FLATTEN=g.flatten, WARP_SPECIALIZE=g.warp_specialize, SUBTILE=g.subtile,
            STORE_Y=y is not None, Y_TMA=g.y_tma, SCALED=ref is not None, RUN_FLAG=run is not None,
            num_warps=g.num_warps, num_stages=g.num_stages)
        if merge:
            _merge_partials_kernel[(rows,)](
                part, rows, n_blocks, m, u, u if t is None else t,
                BLOCK=min(1024, triton.next_power_of_2(n_blocks)), WITH_ENTROPY=t is not None, num_warps=4)
