"""linear_logprobs' tile backend on the fused GEMM (ops/common/vocab_gemm.py): the CUDA path for bf16/fp16 on
sm_90+, its statistics in the forward GEMM's epilogue and its dlogits in the backward's.

    forward : vocab_gemm.FusedGemm.fold — the statistics of up to vocab_chunk · block_n / 3 columns per launch;
    backward: `_gemm_logits_grad_kernel` recomputes each block of logits and turns it into dlogits in the weight
              dtype (2 B per logit written, nothing read), which the grad_hidden / grad_weight GEMMs (cuBLAS,
              chunk.py) then take, over vocabulary chunks cut to fill whole waves (`wave_fitted_bounds`).

Imported only when impl="fused" (or "auto" on CUDA) is chosen: it imports Triton.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from rltrain_kernels.ops.common.row_pass import dlogits_of
from rltrain_kernels.ops.common.vocab_gemm import FusedGemm, logits_block, multiprocessors, row_grad_terms
from rltrain_kernels.ops.common.vocab_tiles import GemmConfig, GemmThenRowPass, balanced_bounds
from rltrain_kernels.ops.linear_logprobs.chunk import fused_forward_blocks
from rltrain_kernels.utils import triton_interpreted


@triton.jit
def _gemm_logits_grad_kernel(
    a_desc, b_desc, out_ptr, stride_out,
    labels_ptr, row_max_ptr, log_sum_ptr, entropy_ptr, g_logprob_ptr, g_entropy_ptr,
    n_rows, n_cols, hidden_size, vocab_start, inv_temp,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr, HAS_G_LOGPROB: tl.constexpr, HAS_G_ENTROPY: tl.constexpr, FLATTEN: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
):
    """out = ∂loss/∂logits in out's dtype (the maths: row_pass._logits_grad_kernel,
    vocab_tiles.TorchTiles.logits_grad)."""
    n_tiles = tl.cdiv(n_rows, BLOCK_M) * tl.cdiv(n_cols, BLOCK_N)
    for tile in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), flatten=FLATTEN,
                         warp_specialize=WARP_SPECIALIZE):
        acc, rows, cols, _, _ = logits_block(tile, a_desc, b_desc, n_rows, n_cols, hidden_size, BLOCK_M, BLOCK_N,
                                             BLOCK_K, GROUP_M, UPCAST)
        row_ok = rows < n_rows
        row_max = tl.load(row_max_ptr + rows, mask=row_ok, other=0.0)
        log_sum = tl.load(log_sum_ptr + rows, mask=row_ok, other=0.0)
        # (z − max) − log Σ: exact near the max (z − lse would carry lse's rounding into every p)
        log_p = (acc * inv_temp - row_max[:, None]) - log_sum[:, None]
        g_lp, c0, g_ent, local = row_grad_terms(rows, row_ok, labels_ptr, entropy_ptr, g_logprob_ptr,
                                                g_entropy_ptr, vocab_start, n_cols, HAS_G_LOGPROB, HAS_G_ENTROPY)
        d = dlogits_of(log_p, cols[None, :] == local[:, None], g_lp[:, None], c0[:, None], g_ent[:, None],
                       inv_temp, HAS_G_LOGPROB, HAS_G_ENTROPY)
        out = out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :]
        tl.store(out, d.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (cols < n_cols)[None, :])


class FusedTiles(GemmThenRowPass):
    """Tile backend whose GEMMs carry the row passes (see the module docstring).

    Forward: one launch per token chunk over up to vocab_chunk · block_n / 3 columns (the whole vocabulary of
    Qwen-class models): the partials take rows · ceil(cols / block_n) · 12 B, at most the cuBLAS path's fp32 tile.
    Backward: dlogits tiles of token_chunk × up to 2 · vocab_chunk columns in the weight dtype (2 B, where the
    cuBLAS path's fp32 tile takes 4 B: the same workspace bound), the vocabulary split so each launch's blocks
    fill whole waves of the GPU's multiprocessors when a split within the bound does."""

    def __init__(self, gemm: GemmConfig | None = None):
        self.fused = FusedGemm(gemm)

    # -- forward
    def vocab_bounds(self, vocab, rows, config, device, backward):
        block_n = self.fused.config.block_n
        if not backward:
            return balanced_bounds(vocab, fused_forward_blocks(config.vocab_chunk) * block_n, block_n)
        return wave_fitted_bounds(vocab, rows, 2 * config.vocab_chunk, self.fused.config, multiprocessors(device))

    def workspace(self, rows, cols, weight, backward):
        if backward:
            return torch.empty(rows * cols, dtype=weight.dtype, device=weight.device)
        return self.fused.partials(rows, cols, weight.device)

    def fold_logits(self, hidden_t, weight_v, workspace, labels, vocab_start, inv_temp, m, u, t, label_z):
        self.fused.fold(hidden_t, weight_v, workspace, labels, vocab_start, inv_temp, m, u, t, label_z)

    # -- backward
    def logits_grad_of(self, hidden_t, weight_v, workspace, labels, vocab_start, inv_temp, row_max, log_sum,
                       entropy, g_logprob, g_entropy):
        rows, cols = hidden_t.shape[0], weight_v.shape[0]
        g = self.fused.config
        dlogits = workspace[: rows * cols].view(rows, cols)
        a_desc, b_desc = self.fused.descriptors(hidden_t, weight_v)
        _gemm_logits_grad_kernel[self.fused.grid(rows, cols, hidden_t.device)](
            a_desc, b_desc, dlogits, dlogits.stride(0),
            labels, row_max, log_sum, row_max if entropy is None else entropy,
            row_max if g_logprob is None else g_logprob, row_max if g_entropy is None else g_entropy,
            rows, cols, hidden_t.shape[1], vocab_start, inv_temp,
            BLOCK_M=g.block_m, BLOCK_N=g.block_n, BLOCK_K=g.block_k, GROUP_M=g.group_m,
            UPCAST=triton_interpreted(), HAS_G_LOGPROB=g_logprob is not None, HAS_G_ENTROPY=g_entropy is not None,
            FLATTEN=g.flatten, WARP_SPECIALIZE=g.warp_specialize, num_warps=g.num_warps, num_stages=g.num_stages)
        return dlogits


def wave_fitted_bounds(vocab: int, rows: int, limit: int, gemm: GemmConfig, sm_count: int):
    """Split [0, vocab) into chunks of whole column blocks, each ≤ limit columns, choosing among the fewest few
    chunk counts the one whose launches ([rows, chunk] logits in block_m × block_n blocks, one program per SM, of
    sm_count) leave the least of their last wave idle. V = 151936 at 2048 rows on 132 SMs: 6 chunks of 99 blocks,
    1584 blocks a launch = 12 full waves (5 chunks would run 14.4 waves, the last 42% idle)."""
    block_n = gemm.block_n
    col_blocks = triton.cdiv(vocab, block_n)
    row_blocks = triton.cdiv(rows, gemm.block_m)
    fewest = max(1, triton.cdiv(vocab, max(block_n, limit // block_n * block_n)))
    best = None
    for n_chunks in range(fewest, min(col_blocks, fewest + 8) + 1):
        per_chunk = triton.cdiv(col_blocks, n_chunks)
        waves = row_blocks * per_chunk / sm_count
        used = waves / math.ceil(waves)
        if best is None or used > best[0] + 1e-9:
            best = (used, per_chunk)
    size = best[1] * block_n
    return [(start, min(start + size, vocab)) for start in range(0, vocab, size)]
