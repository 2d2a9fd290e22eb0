"""The fused path's chunk logits (impl="fused"): GEMM 1 on the fused GEMM (ops/common/vocab_gemm.py), whose
epilogue folds the row statistics and keeps y = z − (its block's max) in fp16, then a dlogits pass that reads y and
the block maxes and writes dlogits over y for the gradient GEMMs. scaled.py keeps bf16 e^(z − R) in the same
workspace instead where it can (no dlogits pass).

Imported only when the fused path is chosen: it imports Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rltrain_kernels.ops.common.row_pass import dlogits_of
from rltrain_kernels.ops.common.vocab_gemm import FusedGemm, row_grad_terms
from rltrain_kernels.ops.policy_loss.chunk import LossBuffers, shifted_row_bytes


@triton.jit
def _shifted_logits_grad_kernel(
    y_ptr, out_ptr, stride_row, block_max_ptr, n_blocks,
    labels_ptr, row_max_ptr, log_sum_ptr, entropy_ptr, g_logprob_ptr, g_entropy_ptr,
    n_rows, n_cols, vocab_start, inv_temp,
    BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_G_LOGPROB: tl.constexpr, HAS_G_ENTROPY: tl.constexpr,
):
    """out = ∂loss/∂logits from the block-shifted logits y that the fused GEMM's stats kernel kept (vocab_gemm.py,
    STORE_Y): log p = (y + (block max − row max)) − log Σ, the bracket 0 in the blocks holding the row's max. Each
    program takes BLOCK_R rows × BLOCK_V columns; out (the weight dtype) may be y's memory: each element is read,
    then written, by the same program."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < n_rows
    ok = row_ok[:, None] & (cols < n_cols)[None, :]
    rows64 = rows.to(tl.int64)
    block_max = tl.load(block_max_ptr + rows64[:, None] * n_blocks + (cols // BLOCK_N)[None, :], mask=ok, other=0.0)
    row_max = tl.load(row_max_ptr + rows, mask=row_ok, other=0.0)
    log_sum = tl.load(log_sum_ptr + rows, mask=row_ok, other=0.0)
    offsets = rows64[:, None] * stride_row + cols[None, :]
    y = tl.load(y_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
    # masked lanes: log p = 0, finite whatever the row (they are not stored)
    log_p = tl.where(ok, (y + (block_max - row_max[:, None])) - log_sum[:, None], 0.0)
    g_lp, c0, g_ent, local = row_grad_terms(rows, row_ok, labels_ptr, entropy_ptr, g_logprob_ptr, g_entropy_ptr,
                                            vocab_start, n_cols, HAS_G_LOGPROB, HAS_G_ENTROPY)
    d = dlogits_of(log_p, cols[None, :] == local[:, None], g_lp[:, None], c0[:, None], g_ent[:, None], inv_temp,
                   HAS_G_LOGPROB, HAS_G_ENTROPY)
    tl.store(out_ptr + offsets, d.to(out_ptr.dtype.element_ty), mask=ok)


class ShiftedChunkLogits:
    """A chunk's logits through the fused GEMM (Triton, bf16/fp16 on sm_90+), whose epilogue folds the row
    statistics and keeps y = z − (its block's max) in fp16; the dlogits pass reads y and the block maxes and writes
    dlogits over y. ~2 B per logit of workspace (so twice the rows of the dense tile in the same bytes) and no
    statistics pass over memory: GEMM 1 ends with the statistics known. Same contract as chunk.DenseChunkLogits."""

    def __init__(self, fused: FusedGemm):
        self.fused = fused

    def row_bytes(self, vocab: int) -> int:
        """Workspace bytes per row: fp16 y (row stride padded to 16 B) + the partials."""
        return shifted_row_bytes(vocab, self.fused.config.block_n)

    def workspace(self, rows: int, vocab: int, device):
        """(y [rows, vocab] fp16 with a 16 B row stride, TMA's requirement; partials [3·rows·n_blocks] fp32)."""
        y = torch.empty(rows, triton.cdiv(vocab, 8) * 8, dtype=torch.float16, device=device)[:, :vocab]
        return y, self.fused.partials(rows, vocab, device)

    def logits(self, workspace, hidden_c, weight, labels_c, c: LossBuffers, inv_temp, fold: bool,
               keep: bool = True):
        """GEMM 1 for the chunk; fold=True also folds the row statistics into c (m, u, t, label_z). keep=False
        (statistics only: no gradient pass follows, or GSPO's first pass) skips storing y."""
        y, part = workspace
        y = y[: hidden_c.shape[0]]
        self.fold_and_keep(hidden_c, weight, y if keep else None, part, labels_c, inv_temp, c.m, c.u, c.t,
                           c.label_z, fold=fold)
        return y, part

    def fold_and_keep(self, hidden_c, weight, y, part, labels, inv_temp, m, u, t, label_z, fold=True, ref=None,
                      run=None):
        """The statistics of hidden_c @ weight.T (the whole vocabulary) folded into (m, u, t, label_z); also keeps
        y = z − block max in y (fp16; None: not kept) and the block maxes in part for `dlogits` — or with ref
        [rows], y = e^(z − ref) in y's dtype (scaled.py). fold=False (a recompute): y and part only; run: an int32
        flag on the device, the launch skipped while it is 0."""
        self.fused.fold(hidden_c, weight, part, labels, 0, inv_temp, m, u, t, label_z, y=y, ref=ref, run=run,
                        merge=fold)

    def dlogits(self, kept, weight, labels_c, c: LossBuffers, inv_temp):
        """(dlogits [rows, V] in the weight dtype, written over y's memory, None): the gradient GEMMs' operand and
        its row scale (none), as vocab_tiles.TorchTiles.logits_grad computes it from the kept y."""
        y, part = kept
        out = y.view(weight.dtype)
        rows, cols = y.shape
        g = self.fused.config
        row_max, g_logprob, g_entropy = c.m, c.g_logp, c.g_entropy
        _shifted_logits_grad_kernel[(triton.cdiv(rows, g.grad_rows), triton.cdiv(cols, g.grad_cols))](
            y, out, y.stride(0), part, self.fused.n_blocks(cols),
            labels_c, row_max, c.log_sum, row_max if c.entropy is None else c.entropy,
            row_max if g_logprob is None else g_logprob, row_max if g_entropy is None else g_entropy,
            rows, cols, 0, inv_temp, BLOCK_R=g.grad_rows, BLOCK_V=g.grad_cols, BLOCK_N=g.block_n,
            HAS_G_LOGPROB=g_logprob is not None, HAS_G_ENTROPY=g_entropy is not None, num_warps=g.grad_warps)
        return out, None
