"""Triton kernels for the O(tokens) steps of the policy loss (the vocab-wide row passes are ops/common/'s), and
`TritonLossOps`, the same contract as chunk.TorchLossOps.

Imported only when the Triton path is chosen, so `import rltrain_kernels` works without triton. They run on CPU
tensors under TRITON_INTERPRET=1 (how CI tests them); only the common subset of Triton 3.6–3.9 is used (no
libdevice, no early returns). Per chunk of 1024 tokens these are 2 launches reading/writing ~60 KB — noise next to
the row passes over the 622 MB logits tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rltrain_kernels.ops.common.scale import scale_unless_one
from rltrain_kernels.ops.policy_loss.chunk import LossBuffers
from rltrain_kernels.ops.policy_loss import options
from rltrain_kernels.ops.policy_loss.options import PolicyLossOptions

K3_LOG_RATIO_BOUND: tl.constexpr = tl.constexpr(options.K3_LOG_RATIO_BOUND)
K3_BOUND: tl.constexpr = tl.constexpr(options.K3_BOUND)
TOKEN_BLOCK = 1024   # tokens per program for the element-wise kernels: 8 per thread at 4 warps


@triton.jit
def _log1p(u):
    """log(1 + u) to full relative precision for small u (Goldberg's trick; no libdevice in the interpreter)."""
    w = 1.0 + u
    return tl.where(w == 1.0, u, tl.log(w) * (u / tl.where(w == 1.0, 1.0, w - 1.0)))


@triton.jit
def _finalize_kernel(m_ptr, u_ptr, t_ptr, label_z_ptr, mask_ptr, logp_ptr, entropy_ptr, log_sum_ptr, n,
                     BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n
    m = tl.load(m_ptr + offs, mask=inb, other=0.0)
    u = tl.load(u_ptr + offs, mask=inb, other=0.0)
    t = tl.load(t_ptr + offs, mask=inb, other=0.0)
    label_z = tl.load(label_z_ptr + offs, mask=inb, other=0.0)
    valid = tl.load(mask_ptr + offs, mask=inb, other=0.0) != 0
    log_s = _log1p(u)
    tl.store(logp_ptr + offs, tl.where(valid, (label_z - m) - log_s, 0.0), mask=inb)
    tl.store(entropy_ptr + offs, tl.where(valid, log_s - t / (u + 1.0), 0.0), mask=inb)
    tl.store(log_sum_ptr + offs, log_s, mask=inb)


@triton.jit
def _pg_terms(ratio, adv, clip_low, clip_high, dual_clip, HAS_DUAL: tl.constexpr):
    """(pg, ∂pg/∂ratio, clipped) — see chunk.pg_terms."""
    clamped = tl.minimum(tl.maximum(ratio, 1.0 - clip_low), 1.0 + clip_high)
    unclipped_loss = -adv * ratio
    clipped_loss = -adv * clamped
    clipped = clipped_loss > unclipped_loss
    pg = tl.maximum(unclipped_loss, clipped_loss)
    dpg = tl.where(clipped, 0.0, -adv)
    if HAS_DUAL:
        cap = -adv * dual_clip
        capped = (adv < 0) & (cap < pg)
        pg = tl.where(capped, cap, pg)
        dpg = tl.where(capped, 0.0, dpg)
    return pg, dpg, clipped


@triton.jit
def _kl_terms(diff, KL_TYPE: tl.constexpr):
    """diff = logp − ref → (kl, ∂kl/∂logp) for k1/k2/k3 (KL_TYPE 1/2/3)."""
    if KL_TYPE == 1:
        kl = diff
        dkl = diff * 0.0 + 1.0
    elif KL_TYPE == 2:
        kl = 0.5 * diff * diff
        dkl = diff
    else:  # clamped as verl's low_var_kl: log-ratio to [-20, 20], kl to <= 10, gradient 0 where either acts
        x = tl.minimum(tl.maximum(-diff, -K3_LOG_RATIO_BOUND), K3_LOG_RATIO_BOUND)
        e = tl.exp(x)
        kl = e - x - 1.0
        live = (x == -diff) & (kl <= K3_BOUND)
        kl = tl.minimum(kl, K3_BOUND)
        dkl = tl.where(live, 1.0 - e, 0.0)
    return kl, dkl


@triton.jit
def _extra_terms(offs, inb, valid, logp, ref_ptr, entropy_ptr, kl_coef, entropy_coef,
                 KL_TYPE: tl.constexpr, HAS_ENTROPY: tl.constexpr):
    """(kl_coef·kl − entropy_coef·entropy, kl_coef·∂kl/∂logp) for one block of tokens."""
    extra = logp * 0.0
    g_kl = logp * 0.0
    if KL_TYPE != 0:
        ref = tl.load(ref_ptr + offs, mask=inb, other=0.0)
        kl, dkl = _kl_terms(tl.where(valid, logp - ref, 0.0), KL_TYPE)
        extra += kl_coef * kl
        g_kl = kl_coef * dkl
    if HAS_ENTROPY:
        extra -= entropy_coef * tl.load(entropy_ptr + offs, mask=inb, other=0.0)
    return extra, g_kl


@triton.jit
def _token_loss_kernel(logp_ptr, entropy_ptr, mask_ptr, adv_ptr, old_ptr, ref_ptr, w_ptr,
                       g_logp_ptr, contrib_ptr, clipped_ptr, n,
                       clip_low, clip_high, dual_clip, kl_coef, entropy_coef,
                       HAS_DUAL: tl.constexpr, KL_TYPE: tl.constexpr, HAS_ENTROPY: tl.constexpr,
                       BLOCK: tl.constexpr):
    """Token-level ratio: contrib = w·L, clipped, g_logp = w·(∂pg/∂r·r + kl_coef·∂kl/∂logp)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n
    msk = tl.load(mask_ptr + offs, mask=inb, other=0.0)
    valid = msk != 0
    logp = tl.load(logp_ptr + offs, mask=inb, other=0.0)
    old = tl.load(old_ptr + offs, mask=inb, other=0.0)
    adv = tl.load(adv_ptr + offs, mask=inb, other=0.0)
    w = tl.load(w_ptr + offs, mask=inb, other=0.0)
    ratio = tl.exp(tl.where(valid, logp - old, 0.0))
    pg, dpg, clipped = _pg_terms(ratio, adv, clip_low, clip_high, dual_clip, HAS_DUAL)
    extra, g_kl = _extra_terms(offs, inb, valid, logp, ref_ptr, entropy_ptr, kl_coef, entropy_coef,
                               KL_TYPE, HAS_ENTROPY)
    tl.store(contrib_ptr + offs, w * (pg + extra), mask=inb)
    tl.store(clipped_ptr + offs, (valid & clipped).to(tl.float32), mask=inb)
    tl.store(g_logp_ptr + offs, w * (dpg * ratio + g_kl), mask=inb)


@triton.jit
def _sequence_loss_kernel(logp_ptr, entropy_ptr, mask_ptr, adv_ptr, old_ptr, ref_ptr, w_ptr,
                          g_logp_ptr, contrib_ptr, clipped_ptr, seq_len,
                          clip_low, clip_high, dual_clip, kl_coef, entropy_coef,
                          HAS_DUAL: tl.constexpr, KL_TYPE: tl.constexpr, HAS_ENTROPY: tl.constexpr,
                          BLOCK: tl.constexpr):
    """GSPO: one program per sequence. r_s = exp(Σ m·(logp − old) / Σ m); every token uses r_s;
    g_logp_t = w_t·kl_coef·∂kl/∂logp_t + (Σ_t' w_t'·∂pg/∂r)·r_s·m_t / n_s."""
    base = tl.program_id(0).to(tl.int64) * seq_len
    acc_log_ratio = tl.zeros([BLOCK], dtype=tl.float32)
    acc_n = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, seq_len, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        inb = idx < seq_len
        offs = base + idx
        msk = tl.load(mask_ptr + offs, mask=inb, other=0.0)
        logp = tl.load(logp_ptr + offs, mask=inb, other=0.0)
        old = tl.load(old_ptr + offs, mask=inb, other=0.0)
        acc_log_ratio += tl.where(msk != 0, (logp - old) * msk, 0.0)
        acc_n += msk
    n_tokens = tl.sum(acc_n, axis=0)
    n_safe = tl.where(n_tokens > 0, n_tokens, 1.0)
    ratio = tl.exp(tl.where(n_tokens > 0, tl.sum(acc_log_ratio, axis=0) / n_safe, 0.0))
    acc_g = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, seq_len, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        inb = idx < seq_len
        offs = base + idx
        valid = tl.load(mask_ptr + offs, mask=inb, other=0.0) != 0
        logp = tl.load(logp_ptr + offs, mask=inb, other=0.0)
        adv = tl.load(adv_ptr + offs, mask=inb, other=0.0)
        w = tl.load(w_ptr + offs, mask=inb, other=0.0)
        pg, dpg, clipped = _pg_terms(ratio, adv, clip_low, clip_high, dual_clip, HAS_DUAL)
        extra, g_kl = _extra_terms(offs, inb, valid, logp, ref_ptr, entropy_ptr, kl_coef, entropy_coef,
                                   KL_TYPE, HAS_ENTROPY)
        acc_g += w * dpg
        tl.store(contrib_ptr + offs, w * (pg + extra), mask=inb)
        tl.store(clipped_ptr + offs, (valid & clipped).to(tl.float32), mask=inb)
    scale = tl.sum(acc_g, axis=0) * ratio / n_safe
    # third sweep recomputes the KL slope instead of re-reading g_logp: no store→load ordering to rely on
    for start in range(0, seq_len, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        inb = idx < seq_len
        offs = base + idx
        msk = tl.load(mask_ptr + offs, mask=inb, other=0.0)
        valid = msk != 0
        logp = tl.load(logp_ptr + offs, mask=inb, other=0.0)
        w = tl.load(w_ptr + offs, mask=inb, other=0.0)
        extra, g_kl = _extra_terms(offs, inb, valid, logp, ref_ptr, entropy_ptr, kl_coef, 0.0, KL_TYPE, False)
        tl.store(g_logp_ptr + offs, w * g_kl + scale * msk, mask=inb)


class TritonLossOps:
    """finalize / loss on CUDA tensors (or CPU tensors under TRITON_INTERPRET=1)."""

    @staticmethod
    def finalize(b: LossBuffers) -> None:
        n = b.mask.numel()
        _finalize_kernel[(triton.cdiv(n, TOKEN_BLOCK),)](
            b.m, b.u, b.t, b.label_z, b.mask, b.logp, b.entropy, b.log_sum, n, BLOCK=TOKEN_BLOCK, num_warps=4)

    @staticmethod
    def loss(b: LossBuffers, opts: PolicyLossOptions, seq_len: int | None) -> None:
        n = b.mask.numel()
        ref = b.ref if b.ref is not None else b.old   # placeholder pointer, never read when KL_TYPE == 0
        args = (b.logp, b.entropy, b.mask, b.adv, b.old, ref, b.weight, b.g_logp, b.contrib, b.clipped)
        scalars = (opts.clip_low, opts.clip_high, opts.dual_clip or 0.0, opts.kl_coef, opts.entropy_coef)
        flags = dict(HAS_DUAL=opts.dual_clip is not None, KL_TYPE=opts.kl_index,
                     HAS_ENTROPY=opts.entropy_coef != 0.0)
        if seq_len is None:
            _token_loss_kernel[(triton.cdiv(n, TOKEN_BLOCK),)](*args, n, *scalars, **flags, BLOCK=TOKEN_BLOCK,
                                                               num_warps=4)
        elif n:
            block = min(TOKEN_BLOCK, triton.next_power_of_2(max(seq_len, 16)))
            _sequence_loss_kernel[(n // seq_len,)](*args, seq_len, *scalars, **flags, BLOCK=block, num_warps=4)

    @staticmethod
    def scale_unless_one(grad: torch.Tensor, scale: torch.Tensor, block: int | None = None,
                         programs: int | None = None) -> None:
        """grad (contiguous) *= scale in place, skipped on the GPU when scale == 1 (ops/common/scale.py)."""
        scale_unless_one(grad, scale, block, programs)
