"""Token-chunked driver of `linear_kl_div`, shared by the torch and the Triton paths.

Per chunk of `rows` tokens, over the whole vocabulary at once (README.md has the maths):

    S = hidden_c @ weight.T                   GEMM 1, cuBLAS, fp32 tile [rows, V]  (student logits)
    T = teacher_hidden_c @ teacher_weight.T   GEMM 2, cuBLAS, fp32 tile [rows, V]  (teacher logits)
    row pass over (S, T): per-token KL; dlogits = scale_t · ∂KL_t/∂logits written over S in the weight dtype
    grad_hidden_c  = dlogits @ weight         GEMM 3 (fp32 out: the full-V reduction rounded once)
    grad_weight   += dlogits.T @ hidden_c     GEMM 4

A reduced loss (sum / mean / batchmean) knows each token's weight `scale_t` in the forward, so the gradients are
computed there: 4 GEMMs in all, the teacher's once. reduction="none" learns its per-token weights only in the
backward: its forward runs GEMMs 1-2 and the KL part of the row pass, its backward all four again (6 GEMMs, the
teacher's twice). The row pass is a backend: TorchKLRows here (CPU/NPU, readable) or kernel.TritonKLRows.

A chunk spans the whole vocabulary because each token's KL and gradient need both distributions' normalisers
(log Σ e^z over all of V) before any dlogits can be written; 2-D tiles would need GEMMs 1-2 twice (README.md).
The workspace is the two fp32 tiles, 8·rows·V bytes, whatever the number of tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from rltrain_kernels.ops.common.vocab_tiles import addmm_fp32, balanced_bounds, mm_fp32


@dataclass(frozen=True)
class KLDivChunkConfig:
    """Tokens per chunk. The workspace is rows·V·8 B (the student's and the teacher's fp32 logits tiles; the
    student's turns into dlogits in place) + rows·H·4 B (grad_hidden's fp32 accumulator, half inputs only).

    Default: 768 MiB → 640 rows at V = 151936 (742 MiB), leaving the 1 GiB goal for cuBLAS' workspace and the
    per-token vectors. GEMM 4 then reads and writes grad_weight once per chunk with a reduction of K = rows, i.e.
    ~rows/2 = 320 flop per byte of grad_weight traffic, above the ~230 at which a bf16 GEMM stops being
    compute-bound on H100 (767 TFLOP/s over 3.35 TB/s); `bench_kl_div.py --token-chunks` times other sizes.
    """

    workspace_bytes: int = 768 * 2**20
    token_chunk: int | None = None    # explicit rows per chunk (overrides workspace_bytes)
    align: int = 128                  # rows are a multiple of this (GEMM tile edge)
    # Triton row-pass block, 8 fp32 per thread: 1024 → 4 warps. The pass keeps six lane vectors: 84–88 registers
    # (sm_90, Triton 3.6), so 5 programs of 4 warps share an SM and 640 rows run in one wave on 132 SMs; at 2048 /
    # 8 warps only 2 fit (2.4 waves, the last 40% idle), and each program is a whole row of V columns.
    block_v: int = 1024
    # Half inputs: accumulate grad_weight over the chunks in an fp32 [V, H] buffer (V·H·4 B: 1.16 GiB at V=151936,
    # H=2048), rounded once, instead of in the weight dtype (one rounding per chunk: ~4e-3 relative error after 13
    # bf16 roundings, ~8e-3 after 52, for independent chunk contributions).
    grad_weight_fp32: bool = False

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "grad_weight_fp32":
                if not isinstance(value, bool):
                    raise ValueError(f"KLDivChunkConfig.grad_weight_fp32 must be a bool, got {value!r}")
            elif value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"KLDivChunkConfig.{f.name} must be a positive int, got {value!r}")
        if self.block_v & (self.block_v - 1):
            raise ValueError(f"KLDivChunkConfig.block_v must be a power of two, got {self.block_v}")

    def rows(self, vocab: int) -> int:
        """Tokens per chunk: token_chunk, else as many whole `align`s as fit workspace_bytes at 8·vocab per row."""
        if self.token_chunk is not None:
            return self.token_chunk
        return max(self.align, self.workspace_bytes // (8 * vocab) // self.align * self.align)


DEFAULT_CHUNKS = KLDivChunkConfig()


def workspace_bytes(n_tokens: int, vocab: int, hidden_size: int, dtype: torch.dtype,
                    config: KLDivChunkConfig = DEFAULT_CHUNKS) -> int:
    """Bytes of scratch one call allocates beyond its inputs, outputs, gradients and O(tokens) vectors: the two fp32
    tiles of the largest chunk, plus for half inputs the fp32 grad_hidden accumulator (and grad_weight's, with
    grad_weight_fp32)."""
    bounds = balanced_bounds(n_tokens, config.rows(vocab), config.align)
    rows = max((b - a for a, b in bounds), default=0)
    half = dtype != torch.float32
    accumulators = (rows * hidden_size * 4 if half else 0) + (vocab * hidden_size * 4 if half and rows and
                                                              config.grad_weight_fp32 else 0)
    return 2 * rows * vocab * 4 + accumulators


class TorchKLRows:
    """The row pass in plain torch (CPU/NPU path; the readable twin of kernel.TritonKLRows). Allocates a few
    tile-sized temporaries per call, still independent of the number of tokens."""

    def __call__(self, student, teacher, dlogits, valid, scale, kl, inv_temp: float, reverse: bool) -> None:
        """student, teacher: [rows, V] fp32 logits tiles. Writes kl [rows] (0 where not valid) and, when dlogits
        is given (it may alias student), dlogits = scale·∂KL/∂logits (0 on rows that are not valid):
        forward KL(t‖s): ∂/∂z_s = p_s − p_t; reverse KL(s‖t): ∂/∂z_s = p_s·(log p_s − log p_t − KL); ×inv_temp.
        In the kernel's form (kernel.py): p = the distribution averaged over, anchored at its max column."""
        z_s, z_t = student * inv_temp, teacher * inv_temp
        z_p, z_q = (z_s, z_t) if reverse else (z_t, z_s)
        big_p, arg_p = z_p.max(dim=1, keepdim=True)
        big_q = z_q.amax(dim=1, keepdim=True)
        anchor = z_q.gather(1, arg_p)
        e_p = torch.exp(z_p - big_p)
        y = (z_p - big_p).sub_(z_q - anchor)              # exactly 0 at p's max column
        sum_p = e_p.sum(1, keepdim=True)
        log_p, log_q = sum_p.log(), torch.exp(z_q - big_q).sum(1, keepdim=True).log()
        c_mean = (e_p * y).sum(1, keepdim=True) / sum_p
        row_kl = (c_mean - log_p - (anchor - big_q) + log_q).squeeze(1)
        kl.copy_(torch.where(valid, row_kl, 0.0))
        if dlogits is None:
            return
        if reverse:
            d = (e_p / sum_p).mul_(y.sub_(c_mean))
        else:
            d = torch.exp((z_s - big_q).sub_(log_q)).sub_(torch.exp((z_t - big_p).sub_(log_p)))
        dlogits.copy_(d.mul_(torch.where(valid, scale * inv_temp, 0.0)[:, None]))

    @staticmethod
    def scale_unless_one(grad: torch.Tensor, scale: torch.Tensor) -> None:
        """grad *= scale in place, skipped when scale == 1 (a host read: no sync on CPU)."""
        if bool(scale != 1.0):
            torch.mul(grad, scale.to(torch.float32), out=grad)


def kl_div_chunks(hidden, weight, teacher_hidden, teacher_weight, valid, scale, inv_temp: float, reverse: bool,
                  rows_pass, config: KLDivChunkConfig, need_grad_hidden: bool, need_grad_weight: bool):
    """hidden [N, H], weight [V, H], teacher_hidden [N, H_t], teacher_weight [V, H_t], valid [N] bool, scale [N]
    fp32 or None (no gradients) → (kl [N] fp32, grad_hidden [N, H] or None, grad_weight [V, H] or None), the
    gradients of Σ_t scale_t·KL_t."""
    n, h = hidden.shape
    v = weight.shape[0]
    f32 = dict(dtype=torch.float32, device=hidden.device)
    grads = scale is not None and (need_grad_hidden or need_grad_weight)
    kl = torch.empty(n, **f32)
    grad_hidden = torch.empty(n, h, dtype=hidden.dtype, device=hidden.device) if grads and need_grad_hidden else None
    grad_weight = (torch.empty(v, h, dtype=weight.dtype, device=weight.device) if grads and need_grad_weight
                   else None)
    bounds = balanced_bounds(n, config.rows(v), config.align)
    if not bounds:
        for g in (grad_hidden, grad_weight):
            if g is not None:
                g.zero_()
        return kl, grad_hidden, grad_weight
    max_rows = max(b - a for a, b in bounds)
    tiles = torch.empty(2, max_rows * v, **f32)
    # fp32 inputs write grad_hidden straight from the GEMM; half inputs through one fp32 [rows, H] buffer, so the
    # K = V reduction is rounded once (a bf16-output GEMM may reduce cuBLAS' split-K partials in bf16)
    half = hidden.dtype != torch.float32
    accumulator = torch.empty(max_rows * h, **f32) if grad_hidden is not None and half else None
    weight_acc = (torch.empty(v, h, **f32) if grad_weight is not None and half and config.grad_weight_fp32
                  else None)
    for i, (r0, r1) in enumerate(bounds):
        rows = r1 - r0
        hidden_c = hidden[r0:r1]
        student = mm_fp32(hidden_c, weight.t(), out=tiles[0, : rows * v].view(rows, v))
        teacher = mm_fp32(teacher_hidden[r0:r1], teacher_weight.t(), out=tiles[1, : rows * v].view(rows, v))
        dlogits = None
        if grads:   # over the student tile: row r's half-width values lie inside row r's fp32 values
            dlogits = student if weight.dtype == torch.float32 else student.view(weight.dtype)[:, :v]
        rows_pass(student, teacher, dlogits, valid[r0:r1], None if scale is None else scale[r0:r1], kl[r0:r1],
                  inv_temp, reverse)
        if grad_hidden is not None:
            if accumulator is None:
                torch.mm(dlogits, weight, out=grad_hidden[r0:r1])
            else:
                grad_hidden[r0:r1].copy_(mm_fp32(dlogits, weight, out=accumulator[: rows * h].view(rows, h)))
        if weight_acc is not None:
            addmm_fp32(weight_acc, dlogits.t(), hidden_c, beta=0.0 if i == 0 else 1.0)
        elif grad_weight is not None:
            torch.addmm(grad_weight, dlogits.t(), hidden_c, beta=0.0 if i == 0 else 1.0, out=grad_weight)
    if weight_acc is not None:
        grad_weight.copy_(weight_acc)
    return kl, grad_hidden, grad_weight
