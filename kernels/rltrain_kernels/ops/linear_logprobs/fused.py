"""GEMMs with linear_logprobs' row passes fused into their epilogues: the CUDA path for bf16/fp16 inputs.

The cuBLAS path (chunk.py + kernel.py) writes every fp32 logits tile to memory and reads it back in a row pass:
8 B/logit of traffic per GEMM beyond the GEMM's own, plus cuBLAS' fp32-output epilogue. Here one Triton kernel
computes a [BLOCK_M, BLOCK_N] block of logits on the tensor cores and uses it while it is still in registers:

    forward : `_gemm_stats_kernel` folds the block into per-row partial statistics of z = logits / T relative to
              the block's max (max, Σexp − 1, Σexp·(z − max)) and picks the label logit; the partials, 12 B per row
              per block of BLOCK_N columns, are merged by `merge_partials` (the same exact-count form as the row
              pass: the blocks holding the max contribute their 1 as an integer count, so log1p(u) stays exact);
    backward: `_gemm_logits_grad_kernel` turns the block into dlogits in the weight dtype (2 B/logit written),
              which the grad_hidden / grad_weight GEMMs (cuBLAS, chunk.py) then read.

fp32 inputs keep the cuBLAS path: their tensor-core rate is tf32's, which would cost precision here.
Imported lazily (triton); runs on CPU tensors under TRITON_INTERPRET=1 with small blocks, how CI tests it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from rltrain_kernels.ops.linear_logprobs.chunk import ChunkConfig, _balanced_bounds
from rltrain_kernels.ops.linear_logprobs.kernel import TritonTiles
from rltrain_kernels.utils import triton_interpreted


@triton.jit
def _block_ids(n_rows, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Grouped order: GROUP_M row blocks sweep the columns together, so each weight block is read from DRAM once
    per group and the group's hidden rows stay in L2."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(n_rows, BLOCK_M)
    num_n = tl.cdiv(n_cols, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    local = pid % per_group
    return first_m + local % size_m, local // size_m


@triton.jit
def _logits_block(hidden_ptr, stride_h, stride_hk, weight_ptr, stride_w, stride_wk, n_rows, n_cols, hidden_size,
                  pid_m, pid_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  EVEN_K: tl.constexpr, UPCAST: tl.constexpr):
    """fp32 [BLOCK_M, BLOCK_N] = hidden[rows] @ weight[cols].T. Rows/columns past the end are clamped to the last
    valid one (no masks in the K loop); the callers never store or use them. UPCAST (interpreter only: its bf16
    tl.dot returns garbage in Triton 3.9) multiplies in fp32, which is exact for bf16/fp16 products."""
    rows = tl.minimum(pid_m * BLOCK_M + tl.arange(0, BLOCK_M), n_rows - 1).to(tl.int64)
    cols = tl.minimum(pid_n * BLOCK_N + tl.arange(0, BLOCK_N), n_cols - 1).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = hidden_ptr + rows[:, None] * stride_h + ks[None, :] * stride_hk
    b_ptrs = weight_ptr + cols[None, :] * stride_w + ks[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(hidden_size, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            in_k = ks + k * BLOCK_K < hidden_size
            a = tl.load(a_ptrs, mask=in_k[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=in_k[:, None], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_hk
        b_ptrs += BLOCK_K * stride_wk
    return acc


@triton.jit
def _gemm_stats_kernel(
    hidden_ptr, stride_h, stride_hk, weight_ptr, stride_w, stride_wk, labels_ptr, part_ptr, label_z_ptr,
    n_rows, n_cols, hidden_size, n_blocks, plane, vocab_start, inv_temp,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, UPCAST: tl.constexpr, WITH_ENTROPY: tl.constexpr,
):
    """Partials of block j of row r at part[p, r, j] (p = 0: max of z, 1: Σ_{z<max} e^(z−max) + n_max − 1,
    2: Σ e^(z−max)·(z−max)); z[label] stored by the block that holds the label."""
    pid_m, pid_n = _block_ids(n_rows, n_cols, BLOCK_M, BLOCK_N, GROUP_M)
    acc = _logits_block(hidden_ptr, stride_h, stride_hk, weight_ptr, stride_w, stride_wk, n_rows, n_cols,
                        hidden_size, pid_m, pid_n, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, UPCAST)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    col_ok = cols < n_cols
    z = tl.where(col_ok[None, :], acc * inv_temp, -float("inf"))
    block_max = tl.max(z, axis=1)
    y = z - block_max[:, None]                     # −inf on masked columns
    e = tl.exp(y)
    is_max = y == 0.0
    n_max = tl.sum(is_max.to(tl.float32), axis=1)
    rest = tl.sum(tl.where(is_max, 0.0, e), axis=1)
    out = part_ptr + rows.to(tl.int64) * n_blocks + pid_n
    tl.store(out, block_max, mask=row_ok)
    tl.store(out + plane, rest + (n_max - 1.0), mask=row_ok)
    if WITH_ENTROPY:
        tl.store(out + 2 * plane, tl.sum(tl.where(col_ok[None, :], e * y, 0.0), axis=1), mask=row_ok)
    local = tl.load(labels_ptr + rows, mask=row_ok, other=-1) - vocab_start
    hit = cols[None, :] == local[:, None]
    z_label = tl.sum(tl.where(hit, z, 0.0), axis=1)
    inside = row_ok & (local >= pid_n * BLOCK_N) & (local < pid_n * BLOCK_N + BLOCK_N) & (local < n_cols)
    tl.store(label_z_ptr + rows, z_label, mask=inside)


@triton.jit
def _gemm_logits_grad_kernel(
    hidden_ptr, stride_h, stride_hk, weight_ptr, stride_w, stride_wk, out_ptr, stride_out,
    labels_ptr, row_max_ptr, log_sum_ptr, entropy_ptr, g_logprob_ptr, g_entropy_ptr,
    n_rows, n_cols, hidden_size, vocab_start, inv_temp,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, UPCAST: tl.constexpr, HAS_G_LOGPROB: tl.constexpr, HAS_G_ENTROPY: tl.constexpr,
):
    """out = ∂loss/∂logits (see kernel._logits_grad_kernel for the maths), in out's dtype."""
    pid_m, pid_n = _block_ids(n_rows, n_cols, BLOCK_M, BLOCK_N, GROUP_M)
    acc = _logits_block(hidden_ptr, stride_h, stride_hk, weight_ptr, stride_w, stride_wk, n_rows, n_cols,
                        hidden_size, pid_m, pid_n, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, UPCAST)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    col_ok = cols < n_cols
    row_max = tl.load(row_max_ptr + rows, mask=row_ok, other=0.0)
    log_sum = tl.load(log_sum_ptr + rows, mask=row_ok, other=0.0)
    # (z − max) − log Σ: exact near the max (z − lse would carry lse's rounding into every p)
    log_p = (acc * inv_temp - row_max[:, None]) - log_sum[:, None]
    p = tl.exp(log_p)
    if HAS_G_LOGPROB:
        g_lp = tl.load(g_logprob_ptr + rows, mask=row_ok, other=0.0)
    else:
        g_lp = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if HAS_G_ENTROPY:
        g_ent = tl.load(g_entropy_ptr + rows, mask=row_ok, other=0.0)
        c0 = g_lp + g_ent * tl.load(entropy_ptr + rows, mask=row_ok, other=0.0)
        d = -p * (c0[:, None] + g_ent[:, None] * log_p)
    else:
        d = -p * g_lp[:, None]
    if HAS_G_LOGPROB:
        local = tl.load(labels_ptr + rows, mask=row_ok, other=-1) - vocab_start
        d = tl.where(cols[None, :] == local[:, None], d + g_lp[:, None], d)
    d = d * inv_temp
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :]
    tl.store(out, d.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


# ----------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GemmConfig:
    """Block shape and launch of the fused GEMMs. Default: 128 × 256 × 64, 8 warps, 3 stages (see
    kernels/benchmarks/RESULTS.md for the sweep it was picked from)."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3

    @staticmethod
    def default() -> "GemmConfig":
        # the interpreter runs a block as numpy arrays: small blocks keep CI's shapes crossing block edges
        return GemmConfig(16, 32, 16, 2, 4, 1) if triton_interpreted() else GemmConfig()


def merge_partials(parts: torch.Tensor, m: torch.Tensor, u: torch.Tensor, t: torch.Tensor | None) -> None:
    """Fold per-block partials parts [3, rows, blocks] (max, Σexp − 1, Σexp·shift, each relative to its block's
    max) into the running per-row statistics m, u, t (same meaning, relative to the row's max so far), in place.
    Σexp = Σ_j (u_j + 1)·α_j with α_j = e^(m_j − M); partials at the max contribute their 1 as an exact count."""
    pm, pu = parts[0], parts[1]
    new_m = torch.maximum(m, pm.amax(dim=1))
    shift = pm - new_m.unsqueeze(1)                 # finite: every block holds a column
    alpha = torch.exp(shift)
    at_max = shift == 0
    run_shift = m - new_m                           # −inf while the row is empty
    run_alpha = torch.exp(run_shift)
    run_at_max = run_shift == 0
    if t is not None:
        run_s = u + 1.0
        t.copy_((alpha * (parts[2] + shift * (pu + 1.0))).sum(dim=1)
                + run_alpha * (t + torch.where(run_s > 0, run_shift, 0.0) * run_s))
    count = at_max.sum(dim=1, dtype=torch.float32) + run_at_max.to(torch.float32)
    u.copy_((pu * alpha + torch.where(at_max, 0.0, alpha)).sum(dim=1)
            + u * run_alpha + torch.where(run_at_max, 0.0, run_alpha) + (count - 1.0))
    m.copy_(new_m)


class FusedTiles(TritonTiles):
    """Tile backend whose GEMMs carry the row passes (bf16/fp16); fp32 inputs take TritonTiles' cuBLAS path.

    Forward: one launch per token chunk over this rank's whole vocabulary (many blocks, so the last wave of the
    grid is a small fraction); workspace = the partials, rows · ceil(V / block_n) · 12 B (0.4 MiB per 64 rows at
    V = 151936). Backward: tiles of token_chunk × 2·vocab_chunk, since dlogits take 2 B where the cuBLAS path's
    fp32 tile takes 4 B: the same workspace bound."""

    def __init__(self, block_v: int, gemm: GemmConfig | None = None):
        super().__init__(block_v)
        self.gemm = gemm or GemmConfig.default()

    @staticmethod
    def _fused(weight: torch.Tensor) -> bool:
        return weight.dtype in (torch.bfloat16, torch.float16)

    def vocab_bounds(self, vocab, config: ChunkConfig, weight, backward):
        if not self._fused(weight):
            return super().vocab_bounds(vocab, config, weight, backward)
        if not backward:
            return [(0, vocab)] if vocab else []
        return _balanced_bounds(vocab, 2 * config.vocab_chunk, config.align)

    def workspace_numel(self, rows, cols, weight, backward):
        if not self._fused(weight):
            return super().workspace_numel(rows, cols, weight, backward)
        if backward:
            return (rows * cols + 1) // 2          # dlogits in the weight dtype, in an fp32 buffer
        return 3 * rows * triton.cdiv(cols, self.gemm.block_n)

    def _launch(self, kernel, hidden_t, weight_v, *args, **constexprs):
        g = self.gemm
        rows, cols = hidden_t.shape[0], weight_v.shape[0]
        grid = (triton.cdiv(rows, g.block_m) * triton.cdiv(cols, g.block_n),)
        kernel[grid](hidden_t, hidden_t.stride(0), hidden_t.stride(1), weight_v, weight_v.stride(0),
                     weight_v.stride(1), *args,
                     BLOCK_M=g.block_m, BLOCK_N=g.block_n, BLOCK_K=g.block_k, GROUP_M=g.group_m,
                     EVEN_K=hidden_t.shape[1] % g.block_k == 0, UPCAST=triton_interpreted(),
                     num_warps=g.num_warps, num_stages=g.num_stages,
                     **constexprs)

    def fold_logits(self, hidden_t, weight_v, workspace, labels, vocab_start, inv_temp, m, u, t, label_z):
        if not self._fused(weight_v):
            return super().fold_logits(hidden_t, weight_v, workspace, labels, vocab_start, inv_temp, m, u, t,
                                       label_z)
        rows, cols = hidden_t.shape[0], weight_v.shape[0]
        blocks = triton.cdiv(cols, self.gemm.block_n)
        parts = workspace[: 3 * rows * blocks].view(3, rows, blocks)
        self._launch(_gemm_stats_kernel, hidden_t, weight_v, labels, parts, label_z,
                     rows, cols, hidden_t.shape[1], blocks, rows * blocks, vocab_start, inv_temp,
                     WITH_ENTROPY=t is not None)
        merge_partials(parts, m, u, t)

    def logits_grad_of(self, hidden_t, weight_v, workspace, labels, vocab_start, inv_temp, row_max, log_sum,
                       entropy, g_logprob, g_entropy):
        if not self._fused(weight_v):
            return super().logits_grad_of(hidden_t, weight_v, workspace, labels, vocab_start, inv_temp, row_max,
                                          log_sum, entropy, g_logprob, g_entropy)
        rows, cols = hidden_t.shape[0], weight_v.shape[0]
        dlogits = workspace.view(weight_v.dtype)[: rows * cols].view(rows, cols)
        self._launch(_gemm_logits_grad_kernel, hidden_t, weight_v, dlogits, dlogits.stride(0),
                     labels, row_max, log_sum, row_max if entropy is None else entropy,
                     row_max if g_logprob is None else g_logprob, row_max if g_entropy is None else g_entropy,
                     rows, cols, hidden_t.shape[1], vocab_start, inv_temp,
                     HAS_G_LOGPROB=g_logprob is not None, HAS_G_ENTROPY=g_entropy is not None)
        return dlogits
