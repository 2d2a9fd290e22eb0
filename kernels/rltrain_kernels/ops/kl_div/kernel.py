"""The Triton row pass of `linear_kl_div` over a chunk's two fp32 logits tiles (student, teacher) and its launcher
`TritonKLRows`, the same contract as chunk.TorchKLRows.

One program per token: a first loop over the row folds both distributions' statistics and the KL's cross term
online, a second (with gradients) writes dlogits over the student tile. Imported only when a Triton path is chosen;
runs on CPU tensors under TRITON_INTERPRET=1 (how CI tests it). Every offset inside a tile is < rows·V (< 2^31 for
rows ≤ 14000 at V = 151936) and the row offset is int64.

Traffic per logit (both tiles fp32): the first loop reads 8 B, the second reads 8 B and writes 2 B (bf16 dlogits),
after the two GEMMs wrote 8 B: 26 B per logit, ~32 GB at N = 8192, V = 151936, against ~36 ms of GEMMs on H100.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rltrain_kernels.ops.common.scale import scale_unless_one


@triton.jit
def _fold(z, m, s, inb):
    """One column per lane into the lane's running (max m, Σ e^(z − m) = s). Returns (grows, shift, e, m', s'):
    shift = m − m' (≤ 0; −inf when the lane was empty), e = e^(−|z − m|), the new column's weight when it does not
    raise the max and the old sum's rescale when it does (one exp per column); a masked column has e = 0."""
    grows = z > m
    d = tl.where(inb, tl.where(grows, m - z, z - m), -float("inf"))
    e = tl.exp(d)
    s_new = tl.where(grows, s * e + 1.0, s + e)
    return grows, tl.where(grows, d, 0.0), e, tl.maximum(m, z), s_new


@triton.jit
def _kl_rows_kernel(
    student_ptr, teacher_ptr, stride_s, stride_t,   # [rows, n_cols] fp32 logits tiles
    dlogits_ptr, stride_d,                          # [rows, n_cols] weight dtype; may be the student tile's memory
    valid_ptr, scale_ptr, kl_ptr,                   # per row: uint8 0/1, loss weight (fp32), KL out (fp32)
    n_cols, inv_temp,
    BLOCK_V: tl.constexpr, REVERSE: tl.constexpr, WITH_GRAD: tl.constexpr, ALIASED: tl.constexpr,
):
    """KL of one row and, WITH_GRAD, its dlogits = scale·∂KL/∂logits (README.md has the maths).

    p is the distribution the KL averages over (the teacher for forward KL(t‖s), the student for reverse), q the
    other. Each lane keeps, over the columns it visits, both maxima m and sums s = Σ e^(z − m), the anchor a = z_q at
    the column of p's max, and the cross term c = Σ e^(z_p − m_p)·((z_p − m_p) − (z_q − a)). At p's max column that
    term is exactly 0, so when p is (nearly) one-hot the KL and the reverse gradient come from the small terms
    rather than from a difference of large ones. A new p max rescales it: c ← e^δ·(c + (δ − (a_old − a_new))·s_p),
    δ = m_old − m_new. The lanes are merged once at the end, then with A the anchor at the row's p max and
    S = Σ e^(z − M): KL = c/S_p − log S_p − (A − M_q) + log S_q.
    """
    row = tl.program_id(0).to(tl.int64)
    s_row = student_ptr + row * stride_s
    t_row = teacher_ptr + row * stride_t
    d_row = dlogits_ptr + row * stride_d
    valid = tl.load(valid_ptr + row) != 0
    kl = 0.0
    if valid:
        m_p = tl.full((BLOCK_V,), -float("inf"), tl.float32)
        m_q = tl.full((BLOCK_V,), -float("inf"), tl.float32)
        s_p = tl.zeros((BLOCK_V,), tl.float32)
        s_q = tl.zeros((BLOCK_V,), tl.float32)
        a = tl.zeros((BLOCK_V,), tl.float32)
        c = tl.zeros((BLOCK_V,), tl.float32)
        for start in range(0, n_cols, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            inb = cols < n_cols
            z_s = tl.load(s_row + cols, mask=inb, other=-float("inf")) * inv_temp
            z_t = tl.load(t_row + cols, mask=inb, other=-float("inf")) * inv_temp
            if REVERSE:
                z_p, z_q = z_s, z_t
            else:
                z_p, z_q = z_t, z_s
            grows, shift, e, m_p, s_p_new = _fold(z_p, m_p, s_p, inb)
            _, _, _, m_q, s_q = _fold(z_q, m_q, s_q, inb)
            a_new = tl.where(grows, z_q, a)
            # an empty lane (s_p = 0) has c = 0 and a −inf shift: where() keeps 0·(−inf) out; a masked column adds
            # nothing (its z − m is −inf − m); at a new max the new column's own term is exactly 0
            old = tl.where(s_p > 0, tl.where(grows, e, 1.0) * (c + (shift - (a - a_new)) * s_p), 0.0)
            c = old + tl.where(inb, tl.where(grows, 1.0, e) * ((z_p - m_p) - (z_q - a_new)), 0.0)
            s_p = s_p_new
            a = a_new
        big_p = tl.max(m_p, axis=0)
        big_q = tl.max(m_q, axis=0)
        alpha_p = tl.exp(m_p - big_p)     # 0 for lanes that saw no column
        sum_p = tl.sum(s_p * alpha_p, axis=0)
        sum_q = tl.sum(s_q * tl.exp(m_q - big_q), axis=0)
        anchor = tl.max(tl.where(m_p == big_p, a, -float("inf")), axis=0)
        c_row = tl.sum(tl.where(s_p > 0, alpha_p * (c + ((m_p - big_p) - (a - anchor)) * s_p), 0.0), axis=0)
        c_mean = c_row / sum_p
        log_p = tl.log(sum_p)
        log_q = tl.log(sum_q)
        kl = c_mean - log_p - (anchor - big_q) + log_q
        if WITH_GRAD:
            w = tl.load(scale_ptr + row) * inv_temp
            for start in range(0, n_cols, BLOCK_V):
                cols = start + tl.arange(0, BLOCK_V)
                inb = cols < n_cols
                z_s = tl.load(s_row + cols, mask=inb, other=0.0) * inv_temp
                z_t = tl.load(t_row + cols, mask=inb, other=0.0) * inv_temp
                if REVERSE:
                    # p_s·(log p_s − log p_t − KL) with the normalisers cancelled: exact at the student's max
                    y = (z_s - big_p) - (z_t - anchor)
                    d = tl.exp((z_s - big_p) - log_p) * (y - c_mean)
                else:
                    # log p = (z − max) − log Σ: exact near the max (z − lse would carry lse's rounding into p)
                    d = tl.exp((z_s - big_q) - log_q) - tl.exp((z_t - big_p) - log_p)
                if ALIASED:
                    # the half-width store of block j covers fp32 values of blocks ≤ j that other threads load:
                    # every thread has loaded this block before any stores into it
                    tl.debug_barrier()
                tl.store(d_row + cols, (d * w).to(dlogits_ptr.dtype.element_ty), mask=inb)
    else:
        if WITH_GRAD:
            for start in range(0, n_cols, BLOCK_V):
                cols = start + tl.arange(0, BLOCK_V)
                zero = tl.zeros((BLOCK_V,), tl.float32)
                tl.store(d_row + cols, zero.to(dlogits_ptr.dtype.element_ty), mask=cols < n_cols)
    tl.store(kl_ptr + row, kl)


def _launch_config(block_v: int, n_cols: int) -> tuple[int, int]:
    """(block, warps): 8 fp32 per thread per tile and block (two 16 B loads each)."""
    block = min(block_v, triton.next_power_of_2(max(n_cols, 16)))
    return block, max(1, min(8, block // 256))


class TritonKLRows:
    """The row pass in Triton after cuBLAS GEMMs (no temporaries); chunk.TorchKLRows' contract."""

    def __init__(self, block_v: int):
        self.block_v = block_v

    def __call__(self, student, teacher, dlogits, valid, scale, kl, inv_temp: float, reverse: bool) -> None:
        rows, n_cols = student.shape
        if rows == 0:
            return
        block, num_warps = _launch_config(self.block_v, n_cols)
        with_grad = dlogits is not None
        aliased = with_grad and dlogits.data_ptr() == student.data_ptr() and dlogits.dtype != student.dtype
        _kl_rows_kernel[(rows,)](
            student, teacher, student.stride(0), teacher.stride(0),
            dlogits if with_grad else student, dlogits.stride(0) if with_grad else 0,
            valid.view(torch.uint8), scale if with_grad else kl, kl,
            n_cols, inv_temp,
            BLOCK_V=block, REVERSE=reverse, WITH_GRAD=with_grad, ALIASED=aliased, num_warps=num_warps,
        )

    @staticmethod
    def scale_unless_one(grad: torch.Tensor, scale: torch.Tensor) -> None:
        """grad (contiguous) *= scale in place, skipped on the GPU when scale == 1 (ops/common/scale.py)."""
        scale_unless_one(grad, scale)


def check_runnable(device: torch.device) -> None:
    """Triton needs a GPU, or the interpreter for CPU tensors."""
    from rltrain_kernels.utils import triton_interpreted

    if device.type == "cpu" and not triton_interpreted():
        raise ValueError("impl='triton' on CPU tensors needs TRITON_INTERPRET=1 set before triton is imported "
                         "(tests/conftest.py does this when no GPU is present); use impl='torch' otherwise")
