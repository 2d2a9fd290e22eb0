"""The fused path's kept logits in the form the gradient GEMMs take directly, so no dlogits pass runs over memory.

Without an entropy bonus, a token's dlogits are −g·(p − onehot)/T (g = ∂loss/∂logp, T the temperature).
GEMM 1's epilogue keeps E = e^(z − R) in bf16, R a per-row reference fixed before it (the label's logit, one dot
product per row). Since Σ_j e^(z_j − R) = e^(lse − R), every p_j = E_j·e^(R − lse), and with a = −g·e^(R − lse)/T
per row:

    dlogits = a ⊙_rows E'   (E' = E but at the label column: (p − 1)·e^(lse − R) = expm1(logp)·e^(lse − R))
    grad_hidden_c = a ⊙_rows (E' · W)     (cuBLAS, fp32 out; the row scale is the copy into the gradient)
    grad_W       += E'ᵀ · (a ⊙_rows h_c)   (cuBLAS; a ⊙ h_c is a [rows, H] operand)

so the per-element work left after GEMM 1 is one store per row (the label column). Masked rows take R = +inf
(E = 0, a = 0). bf16 keeps fp32's exponent range: E stays finite while lse − R ≤ 88, i.e. while p(label) >
e^-88. A row beyond SAFE_GAP (a token the policy gives p < e^-64) switches to R = lse (then E = p) and GEMM 1 is
recomputed for its chunk — by a launch the GPU skips when no row needed it (no host sync). fp16 (5 exponent bits)
and an entropy bonus (whose gradient needs log p per logit) keep shifted.ShiftedChunkLogits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rltrain_kernels.ops.policy_loss.shifted import ShiftedChunkLogits

SAFE_GAP = 64.0      # lse − R beyond which a row is recomputed with R = lse (E ≤ e^64·p: far inside bf16's range)
ROW_BLOCK = 1024     # rows per program of the O(rows) kernels
DOT_BLOCK = 1024     # hidden elements per step of the label-logit dot product


@triton.jit
def _label_logit_kernel(h_ptr, w_ptr, labels_ptr, mask_ptr, out_ptr, n_cols, hidden_size, stride_h, stride_w,
                        inv_temp, BLOCK_H: tl.constexpr):
    """out[r] = hidden[r] · weight[label[r]] / T in fp32, one program per row; +inf for a masked row (its E is
    then 0: nothing in the gradient GEMMs, whatever its logits). An unmasked label lies in [0, n_cols)
    (check_label_range); the clamp only keeps a masked row's padding label in bounds."""
    row = tl.program_id(0).to(tl.int64)
    label = tl.load(labels_ptr + row)
    label = tl.where((label >= 0) & (label < n_cols), label, 0)
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for start in range(0, hidden_size, BLOCK_H):
        k = start + tl.arange(0, BLOCK_H)
        ok = k < hidden_size
        h = tl.load(h_ptr + row * stride_h + k, mask=ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + label * stride_w + k, mask=ok, other=0.0).to(tl.float32)
        acc += h * w
    masked = tl.load(mask_ptr + row) == 0
    tl.store(out_ptr + row, tl.where(masked, float("inf"), tl.sum(acc, axis=0) * inv_temp))


@triton.jit
def _check_rows_kernel(m_ptr, log_sum_ptr, ref_ptr, mask_ptr, flag_ptr, n, safe_gap, BLOCK: tl.constexpr):
    """Unmasked rows whose lse − R is beyond safe_gap (or not a number) take R = lse and raise the flag. (Masked
    rows hold R = +inf: E = 0.)"""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n
    lse = tl.load(m_ptr + offs, mask=inb, other=0.0) + tl.load(log_sum_ptr + offs, mask=inb, other=0.0)
    ref = tl.load(ref_ptr + offs, mask=inb, other=0.0)
    valid = tl.load(mask_ptr + offs, mask=inb, other=0.0) != 0
    unsafe = inb & valid & ~(lse - ref <= safe_gap)
    tl.store(ref_ptr + offs, lse, mask=unsafe)
    tl.atomic_max(flag_ptr, tl.max(unsafe.to(tl.int32), axis=0))


@triton.jit
def _expm1(x):
    """e^x − 1 to full relative precision for x ≤ 0 near 0 (the log1p trick mirrored; no libdevice)."""
    u = tl.exp(x)
    edge = (u == 1.0) | (u == 0.0)
    return tl.where(u == 1.0, x, tl.where(u == 0.0, -1.0, (u - 1.0) * (x / tl.log(tl.where(edge, 2.0, u)))))


@triton.jit
def _label_column_kernel(e_ptr, stride_e, labels_ptr, logp_ptr, m_ptr, log_sum_ptr, ref_ptr, g_ptr, scale_ptr,
                         n, n_cols, inv_temp, BLOCK: tl.constexpr):
    """a = −g·e^(R − lse)/T per row (0 without a gradient), and E[r, label] = expm1(logp)·e^(lse − R): the one-hot
    folded into the kept logits, from the finalized logp (its exact form (label_z − m) − log Σ)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n
    m = tl.load(m_ptr + offs, mask=inb, other=0.0)
    log_sum = tl.load(log_sum_ptr + offs, mask=inb, other=0.0)
    g = tl.load(g_ptr + offs, mask=inb, other=0.0)
    gap = (m - tl.load(ref_ptr + offs, mask=inb, other=0.0)) + log_sum      # lse − R
    has_grad = inb & (g != 0.0)
    tl.store(scale_ptr + offs, tl.where(has_grad, -g * inv_temp * tl.exp(-tl.where(has_grad, gap, 0.0)), 0.0), mask=inb)
    label = tl.load(labels_ptr + offs, mask=inb, other=-1)
    logp = tl.load(logp_ptr + offs, mask=inb, other=0.0)
    value = _expm1(tl.minimum(logp, 0.0)) * tl.exp(tl.where(has_grad, gap, 0.0))
    ok = has_grad & (label >= 0) & (label < n_cols)
    tl.store(e_ptr + offs * stride_e + label, value.to(e_ptr.dtype.element_ty), mask=ok)


class ScaledChunkLogits(ShiftedChunkLogits):
    """shifted.ShiftedChunkLogits' workspace (2 B per logit, here bf16 E instead of fp16 y) with the module
    docstring's form of the gradient: `dlogits` returns (E', a) and the chunk driver scales rows around its
    GEMMs. Needs bf16 weights and no entropy bonus (function._backends checks). safe_gap: lse − R beyond which a
    row is recomputed with R = lse (default SAFE_GAP)."""

    def __init__(self, fused, safe_gap: float = SAFE_GAP):
        super().__init__(fused)
        self.safe_gap = safe_gap

    def workspace(self, rows: int, vocab: int, device):
        y, part = super().workspace(rows, vocab, device)
        return (y.view(torch.bfloat16), part, torch.empty(rows, dtype=torch.float32, device=device),
                torch.empty(rows, dtype=torch.float32, device=device), torch.zeros(1, dtype=torch.int32, device=device))

    def logits(self, workspace, hidden_c, weight, labels_c, c, inv_temp, fold: bool, keep: bool = True):
        """GEMM 1 keeping E (keep=False: statistics only, as the parent); the references first."""
        e, part, ref, scale, flag = workspace
        rows = hidden_c.shape[0]
        e, ref = e[:rows], ref[:rows]
        if keep:
            _label_logit_kernel[(rows,)](hidden_c, weight, labels_c, c.mask, ref, weight.shape[0], hidden_c.shape[1],
                                         hidden_c.stride(0), weight.stride(0), inv_temp,
                                         BLOCK_H=min(DOT_BLOCK, triton.next_power_of_2(hidden_c.shape[1])))
        self.fold_and_keep(hidden_c, weight, e if keep else None, part, labels_c, inv_temp, c.m, c.u, c.t, c.label_z,
                           fold=fold, ref=ref if keep else None)
        return e, part, ref, scale[:rows], flag, hidden_c

    def dlogits(self, kept, weight, labels_c, c, inv_temp):
        e, part, ref, scale, flag, hidden_c = kept
        rows = e.shape[0]
        grid = (triton.cdiv(rows, ROW_BLOCK),)
        flag.zero_()
        _check_rows_kernel[grid](c.m, c.log_sum, ref, c.mask, flag, rows, self.safe_gap, BLOCK=ROW_BLOCK,
                                 num_warps=4)
        # the recompute for rows that took R = lse: the same GEMM 1, skipped on the GPU while the flag is 0
        self.fold_and_keep(hidden_c, weight, e, part, labels_c, inv_temp, c.m, c.u, None, c.label_z, fold=False,
                           ref=ref, run=flag)
        _label_column_kernel[grid](e, e.stride(0), labels_c, c.logp, c.m, c.log_sum, ref, c.g_logp, scale, rows,
                                   e.shape[1], inv_temp, BLOCK=ROW_BLOCK, num_warps=4)
        return e, scale
