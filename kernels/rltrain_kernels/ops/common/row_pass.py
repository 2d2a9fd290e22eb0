"""Triton row passes over an fp32 logits tile (the LM-head ops' `impl="triton"` path: cuBLAS GEMM, then these) and
their host launchers (`TritonTiles`, a vocab_tiles tile backend); `merge_lanes` and `dlogits_of` are also the
fused GEMM's (vocab_gemm.py) and its dlogits kernels'.

Imported only when a Triton path is chosen, so `import rltrain_kernels` works without triton. The same kernels run
on CPU tensors under TRITON_INTERPRET=1, which is how CI tests them. One program per tile row, looping over the
row in BLOCK_V columns; every offset inside a tile is < token_chunk·vocab_chunk (2^25 by default), and the row
offset is computed in int64, so N·V > 2^31 never reaches a 32-bit index.

Traffic per logit (fp32 tile written by the GEMM): forward pass reads 4 B; backward pass reads 4 B and writes 2 B
(bf16 dlogits). Against 2·H = 8192 GEMM flops per logit per GEMM at H=4096, that is ~9% of the forward GEMM and
~4.5% of the three backward GEMMs at 762 TFLOP/s vs 4.19 TB/s (H200).
"""

from __future__ import annotations

import triton
import triton.language as tl

from rltrain_kernels.ops.common.vocab_tiles import GemmThenRowPass
from rltrain_kernels.utils import triton_interpreted


@triton.jit
def _fold_stats_kernel(
    logits_ptr, stride_row,                       # [rows, n_cols] fp32 tile
    labels_ptr, m_ptr, u_ptr, t_ptr, label_z_ptr,  # per-row, offset to the tile's first row
    n_cols, vocab_start, inv_temp,
    BLOCK_V: tl.constexpr, WITH_ENTROPY: tl.constexpr,
):
    """Fold one tile into the running per-row statistics of z = logits·inv_temp (see vocab_tiles.TorchTiles):
    m = max z, u = Σ exp(z − m) − 1 (kept without the leading 1 so that log1p(u) stays exact when one logit
    dominates), t = Σ exp(z − m)·(z − m), label_z = z[label].

    Each of the BLOCK_V lanes keeps its own running (m, u, t) over the columns it visits, so the loop has no
    cross-lane reduction (no barrier) and one exp per logit: exp(−|z − m|) is the new element's weight when z ≤ m
    and the old sum's rescale when z > m (the new max then counts as an exact 1). The lanes and the row's
    previous statistics are merged once at the end, the lanes holding the max contributing their 1 as an exact
    count. Against four reductions per 2048-column block: 2.40 → 2.29 ms per forward at N=8192, V=151936 on H100
    (4.97 GB read: 2.07 → 2.17 TB/s; RESULTS.md). What is left is mostly launch and ramp: a tile is
    ~57 us of work, 40 tiles per forward."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    lane_m = tl.full((BLOCK_V,), -float("inf"), tl.float32)
    lane_u = tl.full((BLOCK_V,), -1.0, tl.float32)         # Σexp − 1; −1 = the lane has seen nothing
    lane_t = tl.zeros((BLOCK_V,), tl.float32)
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        z = tl.load(row_ptr + cols, mask=cols < n_cols, other=-float("inf")) * inv_temp
        grow = z > lane_m
        d = tl.where(grow, lane_m - z, z - lane_m)          # ≤ 0 (NaN only for z = m = −inf, masked below)
        d = tl.where(z == -float("inf"), -float("inf"), d)
        e = tl.exp(d)
        s = lane_u + 1.0
        if WITH_ENTROPY:
            # d is −inf exactly where e = 0 (an empty lane growing, a masked column): zeroed there before any
            # product, so 0·(−inf) never forms (both where() branches are computed)
            d_safe = tl.where(e > 0, d, 0.0)
            lane_t = tl.where(grow, e * (lane_t + d_safe * s), lane_t + e * d_safe)
        lane_u = tl.where(grow, s * e, lane_u + e)
        lane_m = tl.maximum(lane_m, z)
    t_old = 0.0
    if WITH_ENTROPY:
        t_old = tl.load(t_ptr + row)
    m_new, u, t = merge_lanes(lane_m, lane_u, lane_t, tl.load(m_ptr + row), tl.load(u_ptr + row), t_old,
                              WITH_ENTROPY)
    if WITH_ENTROPY:
        tl.store(t_ptr + row, t)
    tl.store(m_ptr + row, m_new)
    tl.store(u_ptr + row, u)
    local = tl.load(labels_ptr + row) - vocab_start
    inside = (local >= 0) & (local < n_cols)
    z_label = tl.load(row_ptr + tl.where(inside, local, 0), mask=inside, other=0.0) * inv_temp
    previous = tl.load(label_z_ptr + row)
    tl.store(label_z_ptr + row, tl.where(inside, z_label, previous))


@triton.jit
def merge_lanes(lane_m, lane_u, lane_t, m_old, u_old, t_old, WITH_ENTROPY: tl.constexpr):
    """Merge per-lane statistics into a row's running ones and return the merged (m, u, t). Each lane holds
    (m, u = Σexp − 1, t = Σexp·(z − m)) relative to its own max, (−inf, −1, 0) if it saw nothing. Σexp =
    Σ (u + 1)·α with α = e^(m − M); the lanes (and the running state) at the max contribute their 1 as an exact
    count, so log1p(u) keeps its precision when one logit dominates. t_old / the returned t are ignored without
    entropy. Used by the row pass's lanes here and by vocab_gemm.py's per-block partials."""
    m_new = tl.maximum(tl.max(lane_m, axis=0), m_old)
    shift = lane_m - m_new
    alpha = tl.exp(shift)                                   # 0 for lanes that saw nothing
    at_max = shift == 0.0
    old_shift = m_old - m_new                               # −inf before the first tile
    old_alpha = tl.exp(old_shift)
    old_at_max = old_shift == 0.0
    count = tl.sum(at_max.to(tl.float32), axis=0) + old_at_max.to(tl.float32)
    t = t_old
    if WITH_ENTROPY:
        s_old = u_old + 1.0
        lane_s = lane_u + 1.0
        # an empty lane (s = 0, shift = −inf) has α = 0 and t = 0: where() keeps 0·(−inf) from forming
        t = tl.sum(alpha * (lane_t + tl.where(lane_s > 0, shift, 0.0) * lane_s), axis=0)
        t += old_alpha * (t_old + tl.where(s_old > 0, old_shift, 0.0) * s_old)
    u = tl.sum(lane_u * alpha + tl.where(at_max, 0.0, alpha), axis=0)
    u += u_old * old_alpha + tl.where(old_at_max, 0.0, old_alpha) + (count - 1.0)
    return m_new, u, t


@triton.jit
def _logits_grad_kernel(
    logits_ptr, stride_row, dlogits_ptr, stride_drow,  # dlogits may alias logits (same row, ≤ same width)
    labels_ptr, row_max_ptr, log_sum_ptr, entropy_ptr, g_logprob_ptr, g_entropy_ptr,
    n_cols, vocab_start, inv_temp,
    BLOCK_V: tl.constexpr, HAS_G_LOGPROB: tl.constexpr, HAS_G_ENTROPY: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    out_ptr = dlogits_ptr + row * stride_drow
    row_max = tl.load(row_max_ptr + row)
    log_sum = tl.load(log_sum_ptr + row)
    local = tl.load(labels_ptr + row) - vocab_start
    if HAS_G_LOGPROB:
        g_lp = tl.load(g_logprob_ptr + row)
    else:
        g_lp = 0.0
    g_ent = 0.0
    c0 = 0.0
    if HAS_G_ENTROPY:
        g_ent = tl.load(g_entropy_ptr + row)
        # coef_j = g_lp + g_ent·(log p_j + H), as c0 + g_ent·log p_j
        c0 = g_lp + g_ent * tl.load(entropy_ptr + row)
    # Blocks in increasing order: when dlogits is the half-width view of the same row, block j's store covers
    # bytes that blocks ≤ j load. Warps run apart, so every block's loads are fenced from its stores by a
    # barrier: without it a warp's store overwrote logits another warp had not yet read (bf16 grad_hidden off by up
    # to 0.8 relative on an H100, in 40% of 1-row draws; the interpreter runs the warps in order and never showed it).
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < n_cols
        # (z − max) − log Σ: exact near the max; z − lse would carry lse's rounding into every p.
        # Masked lanes get log p = 0: finite whatever the row's max (they are not stored).
        z = tl.load(row_ptr + cols, mask=mask, other=0.0) * inv_temp
        log_p = tl.where(mask, (z - row_max) - log_sum, 0.0)
        d = dlogits_of(log_p, cols == local, g_lp, c0, g_ent, inv_temp, HAS_G_LOGPROB, HAS_G_ENTROPY)
        tl.debug_barrier()
        tl.store(out_ptr + cols, d.to(dlogits_ptr.dtype.element_ty), mask=mask)


@triton.jit
def dlogits_of(log_p, is_label, g_lp, c0, g_ent, inv_temp, HAS_G_LOGPROB: tl.constexpr, HAS_G_ENTROPY: tl.constexpr):
    """∂loss/∂logits from log p: (g_lp·(δ_label − p) − g_ent·p·(log p + H))·inv_temp, with c0 = g_lp + g_ent·H
    (the per-row scalars broadcast against log_p). Shared by every dlogits kernel: this row pass,
    linear_logprobs/fused.py's and policy_loss/shifted.py's."""
    p = tl.exp(log_p)
    if HAS_G_ENTROPY:
        d = -p * (c0 + g_ent * log_p)
    else:
        d = -p * g_lp
    if HAS_G_LOGPROB:
        d = tl.where(is_label, d + g_lp, d)
    return d * inv_temp


def _launch_config(block_v: int, n_cols: int) -> tuple[int, int]:
    block = min(block_v, triton.next_power_of_2(max(n_cols, 16)))
    # 8 warps × 32 lanes × 8 fp32 = 2048: two 16 B loads per thread per block
    num_warps = 8 if block >= 2048 else 4
    return block, num_warps


class TritonTiles(GemmThenRowPass):
    """Row passes in Triton after cuBLAS GEMMs, same contract as vocab_tiles.TorchTiles (no temporaries)."""

    def __init__(self, block_v: int):
        self.block_v = block_v

    def fold_stats(self, tile, labels, vocab_start, inv_temp, m, u, t, label_z):
        rows, n_cols = tile.shape
        block, num_warps = _launch_config(self.block_v, n_cols)
        _fold_stats_kernel[(rows,)](
            tile, tile.stride(0), labels, m, u, u if t is None else t, label_z,
            n_cols, vocab_start, inv_temp,
            BLOCK_V=block, WITH_ENTROPY=t is not None, num_warps=num_warps,
        )

    def logits_grad(self, tile, out, labels, vocab_start, inv_temp, row_max, log_sum, entropy, g_logprob,
                    g_entropy):
        rows, n_cols = tile.shape
        block, num_warps = _launch_config(self.block_v, n_cols)
        _logits_grad_kernel[(rows,)](
            tile, tile.stride(0), out, out.stride(0),
            labels, row_max, log_sum, row_max if entropy is None else entropy,
            row_max if g_logprob is None else g_logprob, row_max if g_entropy is None else g_entropy,
            n_cols, vocab_start, inv_temp,
            BLOCK_V=block, HAS_G_LOGPROB=g_logprob is not None, HAS_G_ENTROPY=g_entropy is not None,
            num_warps=num_warps,
        )


def check_runnable(device: "torch.device") -> None:  # noqa: F821
    """Triton needs a GPU, or the interpreter for CPU tensors."""
    if device.type == "cpu" and not triton_interpreted():
        raise ValueError("impl='triton' on CPU tensors needs TRITON_INTERPRET=1 set before triton is imported "
                         "(tests/conftest.py does this when no GPU is present); use impl='torch' otherwise")
