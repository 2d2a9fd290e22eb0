"""Vocabulary tiling shared by the LM-head ops (`linear_logprobs`, `policy_loss`): chunk bounds, the GEMMs with an
fp32 result, the tile backends' contract and its plain-torch row passes, and the fused GEMM's config.

Both ops visit the tokens × vocab logits one tile at a time, never all of them: a logits GEMM fills the tile, then a
"row pass" folds it into per-row running softmax statistics (max, Σexp, Σexp·shifted logit, label logit) or turns it
into dlogits = ∂loss/∂logits in place. What runs the row passes is a tile backend:

    TorchTiles (here)              torch row passes after cuBLAS/CPU GEMMs: the CPU/NPU path, the readable reference
    row_pass.TritonTiles           Triton row passes after cuBLAS GEMMs (imported lazily: Triton)
    vocab_gemm.FusedGemm           a persistent TMA Triton GEMM with the row passes in its epilogues (lazily too),
                                   configured by GemmConfig below

This module imports no Triton, so the ops' configs and workspace bounds import everywhere.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

from rltrain_kernels.utils import triton_interpreted


def balanced_bounds(total: int, limit: int, align: int) -> list[tuple[int, int]]:
    """Split [0, total) into ceil(total/limit) nearly equal chunks, each a multiple of `align` (but ≤ limit)."""
    if total == 0:
        return []
    n_chunks = math.ceil(total / limit)
    size = math.ceil(total / n_chunks)
    size = min(limit, math.ceil(size / align) * align)
    return [(start, min(start + size, total)) for start in range(0, total, size)]


# ----------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GemmConfig:
    """Block shape and launch of the fused GEMMs (vocab_gemm.py; kernels/benchmarks/RESULTS.md;
    `bench_linear_logprobs.py --tune-fused` times variants): 128 × 256 × 64 at 8 warps and 3 stages ran at cuBLAS'
    speed, 128 × 128 × 64 11% slower; the flattened loop took the forward from 1.30 to 1.17× the floor. block_n's
    default is also what the workspace bounds count in (`GemmConfig.block_n`)."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    group_m: int = 16
    num_warps: int = 8
    num_stages: int = 3
    flatten: bool = True       # tl.range(flatten=): one software pipeline across a program's blocks, so the
                               # next block's loads are in flight during this block's epilogue
    warp_specialize: bool = False   # tl.range(warp_specialize=): a producer warp issues the TMA loads while the
                                    # others compute. Triton 3.6, H100, 8 warps, no flatten: a bare GEMM 3%
                                    # faster, these kernels (64–144 B spilled) 1–2% slower: off (RESULTS.md)
    subtile: bool = True       # the forward epilogue in two column halves: 0 spills where the whole block spilled
    y_tma: bool = True         # kept logits (policy loss): stored through a TMA descriptor, else plain stores
    grad_rows: int = 4         # the policy loss' dlogits pass over the kept logits (policy_loss/shifted.py):
    grad_cols: int = 256       # rows × columns per program, warps
    grad_warps: int = 4

    @staticmethod
    def default() -> "GemmConfig":
        # the interpreter runs a block as numpy arrays: small blocks keep CI's shapes crossing block edges
        if triton_interpreted():
            return GemmConfig(16, 32, 16, 2, 4, 1, grad_cols=64)
        return GemmConfig()


# ----------------------------------------------------------------------------------------------------------------
class Fp32OutputGemms:
    """GEMMs with an fp32 result. On CUDA, half inputs go through cuBLAS' fp32-output mode (`out_dtype`, torch ≥
    2.8): fp32 accumulate and no rounding of the logits to bf16, which at logit std 10 would cost ~3% relative
    error in entropy and gradients. Elsewhere (CPU, NPU) the small operands are upcast instead. A torch without
    those overloads falls back, with one warning per kind, which `native` then remembers.

    native_device: the device type whose half inputs take the fp32-output overloads ("cuda"; a test routes CPU
    tensors there to exercise the fallback, the overloads not existing on CPU)."""

    def __init__(self, native_device: str = "cuda"):
        self.native_device = native_device
        self.native = {"mm": True, "accumulate": True}

    def _fall_back(self, kind: str, err: Exception) -> None:
        self.native[kind] = False
        warnings.warn(f"cuBLAS fp32-output GEMM ({kind}) unavailable in this torch ({type(err).__name__}: {err}); "
                      "using a slower fallback", RuntimeWarning, stacklevel=3)

    def _native_half(self, a: torch.Tensor) -> bool:
        return a.device.type == self.native_device and a.dtype in (torch.bfloat16, torch.float16)

    def mm(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out (fp32) = a @ b."""
        if a.dtype == torch.float32:
            return torch.mm(a, b, out=out)
        if self._native_half(a) and self.native["mm"]:
            try:
                return torch.mm(a, b, out_dtype=torch.float32, out=out)
            except (RuntimeError, TypeError, NotImplementedError) as err:
                self._fall_back("mm", err)
        return torch.mm(a.float(), b.float(), out=out)

    def addmm(self, acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta: float) -> torch.Tensor:
        """acc (fp32) = beta·acc + a @ b; beta=0 ignores acc's contents (NaN included).

        On CUDA through baddbmm's fp32-output overload (addmm's requires self in the input dtype); if this torch
        lacks it, the product is rounded to the input dtype once per call and added (one extra rounding per vocab
        chunk)."""
        if a.dtype == torch.float32:
            return torch.addmm(acc, a, b, beta=beta, out=acc)
        if self._native_half(a):
            if self.native["accumulate"]:
                try:
                    acc3 = acc.unsqueeze(0)
                    torch.baddbmm(acc3, a.unsqueeze(0), b.unsqueeze(0), out_dtype=torch.float32, beta=beta,
                                  out=acc3)
                    return acc
                except (RuntimeError, TypeError, NotImplementedError) as err:
                    self._fall_back("accumulate", err)
            product = torch.mm(a, b)
            return acc.copy_(product) if beta == 0 else acc.add_(product)
        return torch.addmm(acc, a.float(), b.float(), beta=beta, out=acc)


# The ops' fp32-output GEMMs: one process-wide instance, so a torch without the overloads warns once per kind.
_FP32_GEMMS = Fp32OutputGemms()
mm_fp32 = _FP32_GEMMS.mm
addmm_fp32 = _FP32_GEMMS.addmm


# ----------------------------------------------------------------------------------------------------------------
class GemmThenRowPass:
    """A tile backend: what the ops' chunk drivers call per tile. This base runs a logits GEMM (fp32 out, into the
    workspace) and then the subclass' row pass (`fold_stats` / `logits_grad`); linear_logprobs' fused.FusedTiles
    overrides the four methods to do both steps in one kernel per launch."""

    def vocab_bounds(self, vocab: int, rows: int, config, device, backward: bool):
        """The vocabulary chunks a token chunk of `rows` rows is visited in (config: linear_logprobs' ChunkConfig)."""
        return balanced_bounds(vocab, config.vocab_chunk, config.align)

    def workspace(self, rows: int, cols: int, weight: torch.Tensor, backward: bool) -> torch.Tensor:
        """The one scratch buffer of a pass, reused for every tile of at most rows × cols."""
        return torch.empty(rows * cols, dtype=torch.float32, device=weight.device)

    def fold_logits(self, hidden_t, weight_v, workspace, labels, vocab_start, inv_temp, m, u, t, label_z):
        """Fold the logits hidden_t @ weight_v.T into the running row statistics (see TorchTiles.fold_stats)."""
        tile = workspace[: hidden_t.shape[0] * weight_v.shape[0]].view(hidden_t.shape[0], weight_v.shape[0])
        mm_fp32(hidden_t, weight_v.t(), out=tile)
        self.fold_stats(tile, labels, vocab_start, inv_temp, m, u, t, label_z)

    def logits_grad_of(self, hidden_t, weight_v, workspace, labels, vocab_start, inv_temp, row_max, log_sum,
                       entropy, g_logprob, g_entropy) -> torch.Tensor:
        """dlogits [rows, cols] in the weight dtype (a view into the workspace) of the logits hidden_t @ weight_v.T
        (see TorchTiles.logits_grad)."""
        rows, cols = hidden_t.shape[0], weight_v.shape[0]
        tile = workspace[: rows * cols].view(rows, cols)
        mm_fp32(hidden_t, weight_v.t(), out=tile)
        return self.logits_grad_in_place(tile, weight_v.dtype, labels, vocab_start, inv_temp, row_max, log_sum,
                                         entropy, g_logprob, g_entropy)

    def logits_grad_in_place(self, tile, dtype, labels, vocab_start, inv_temp, row_max, log_sum, entropy, g_logprob,
                             g_entropy) -> torch.Tensor:
        """The fp32 logits tile → dlogits in `dtype`, written over it (a view of the tile's memory): row r's
        half-width output lies inside row r's fp32 input and the row pass writes block j only after reading
        blocks ≤ j, so no extra buffer is needed."""
        dlogits = tile if dtype == torch.float32 else tile.view(dtype)[:, : tile.shape[1]]
        # keyword arguments into the row passes: a reordering there fails loudly instead of silently
        self.logits_grad(tile, dlogits, labels=labels, vocab_start=vocab_start, inv_temp=inv_temp, row_max=row_max,
                         log_sum=log_sum, entropy=entropy, g_logprob=g_logprob, g_entropy=g_entropy)
        return dlogits


class TorchTiles(GemmThenRowPass):
    """Row passes in plain torch (CPU/NPU path). Same contract as row_pass.TritonTiles; allocates a few tile-sized
    temporaries per call (so its workspace is ~4 tiles, still independent of N)."""

    @staticmethod
    def fold_stats(tile, labels, vocab_start, inv_temp, m, u, t, label_z):
        """Fold one [rows, cols] fp32 logits tile into the running per-row statistics of z = logits·inv_temp,
        in place: m = max z; u = Σ exp(z − m) − 1, stored without the leading 1 so that log1p(u) is exact when
        one logit dominates (else entropy ≈ V·e^−M loses its log-sum term, a 1/M relative error); t = Σ exp(z −
        m)·(z − m), relative to the max so |z| ≫ 1 does not cancel (None: no entropy); label_z = z[label] when
        the label falls in this tile."""
        z = tile * inv_temp
        block_max = z.amax(dim=1)
        m_new = torch.maximum(m, block_max)
        new_max = block_max > m
        shift = m - m_new                                   # ≤ 0; −inf on the first tile
        alpha = torch.exp(shift)
        is_max = z == block_max.unsqueeze(1)
        n_max = is_max.sum(dim=1, dtype=torch.float32)
        y = z.sub_(m_new.unsqueeze(1))                      # z − m_new, in place
        e = torch.exp(y)
        if t is not None:
            s = u + 1.0
            t.copy_(alpha * (t + torch.where(s > 0, shift, 0.0) * s) + (e * y).sum(dim=1))
        rest = e.masked_fill_(is_max, 0.0).sum(dim=1)
        u.copy_(u * alpha + rest + torch.where(new_max, alpha + (n_max - 1.0), n_max * torch.exp(block_max - m_new)))
        m.copy_(m_new)
        local = labels - vocab_start
        inside = (local >= 0) & (local < tile.shape[1])
        picked = tile.gather(1, local.clamp(0, tile.shape[1] - 1).unsqueeze(1)).squeeze(1) * inv_temp
        label_z.copy_(torch.where(inside, picked, label_z))

    @staticmethod
    def logits_grad(tile, out, labels, vocab_start, inv_temp, row_max, log_sum, entropy, g_logprob, g_entropy):
        """out = ∂loss/∂logits for the tile, from z = tile·inv_temp, log p = (z − row_max) − log_sum (in this
        order: z − max is exact near the max, z − lse would carry lse's rounding, 3e-5 at |z| ≈ 300, into every p):
        ∂/∂z_j = g_lp·(δ_j,label − p_j) − g_ent·p_j·(log p_j + H); times inv_temp for ∂/∂logits.
        g_logprob / g_entropy may be None (that output unused). `out` may alias `tile`."""
        y = (tile * inv_temp - row_max.unsqueeze(1)).sub_(log_sum.unsqueeze(1))   # log p
        p = torch.exp(y)
        coef = torch.zeros_like(row_max) if g_logprob is None else g_logprob
        coef = coef.unsqueeze(1)
        if g_entropy is not None:
            coef = coef + g_entropy.unsqueeze(1) * (y + entropy.unsqueeze(1))
        d = -p * coef
        if g_logprob is not None:
            local = labels - vocab_start
            inside = (local >= 0) & (local < tile.shape[1])
            d.scatter_add_(1, local.clamp(0, tile.shape[1] - 1).unsqueeze(1),
                           torch.where(inside, g_logprob, torch.zeros_like(g_logprob)).unsqueeze(1))
        out.copy_(d.mul_(inv_temp))
