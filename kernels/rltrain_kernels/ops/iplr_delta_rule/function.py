"""The IPLR delta rule's public entry points and their autograd Functions: `chunk_iplr_delta_rule` for training and
prefill, `fused_recurrent_iplr_delta_rule` for decoding.

Chunked: forward kernels in chunk_fwd.py, backward kernels in chunk_bwd.py, the shared chunk machinery in
ops/common/. The backward keeps only T = (I − strict(A Bᵀ))⁻¹ and strict(A Kᵀ) per chunk from the forward and reruns
the state pass for the chunk states and the a-reads X (cheaper than keeping [chunks, H, K, V] states alive between
forward and backward).

Fused recurrent: the forward is fused_recurrent.py's kernel; the path is forward-only by itself, so its backward runs
the chunked backward from scratch (chunk_iplr_delta_rule_bwd_recompute: same maths).
"""

from __future__ import annotations

import torch

from ..common.chunking import CHUNK_SIZE, chunk_layout, flatten_tokens
from ..common.inputs import check_chunk_dims, check_chunk_size
from ..common.precision import check_dot, iplr_dot_precision
from ..common.tuning import DEFAULT_TUNING, Tuning, check_tuning
from .chunk_bwd import chunk_iplr_delta_rule_bwd
from .chunk_fwd import chunk_iplr_delta_rule_fwd
from .fused_recurrent import fused_recurrent_iplr_delta_rule_fwd
from .inputs import check_inputs
from .naive import naive_recurrent_iplr_delta_rule


class ChunkIPLRDeltaRuleFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, a, b, scale, initial_state, output_final_state, cu_seqlens, chunk_size, dot_prec,
                tuning):
        B, T, H, _ = q.shape
        V = v.shape[-1]
        layout = chunk_layout(B, T, cu_seqlens, chunk_size, q.device)
        o, ht, (Ai, Ak) = chunk_iplr_delta_rule_fwd(*map(flatten_tokens, (q, k, v, a, b)), scale, initial_state,
                                                    output_final_state, layout, dot_prec=dot_prec, tuning=tuning)
        ctx.save_for_backward(q, k, v, a, b, initial_state, Ai, Ak)
        ctx.layout, ctx.scale, ctx.dot_prec, ctx.tuning = layout, scale, dot_prec, tuning
        return o.view(B, T, H, V), ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, a, b, initial_state, Ai, Ak = ctx.saved_tensors
        grads = chunk_iplr_delta_rule_bwd(*map(flatten_tokens, (q, k, v, a, b)), ctx.scale, initial_state, Ai, Ak,
                                          flatten_tokens(do), None if dht is None else dht.contiguous(), ctx.layout,
                                          dot_prec=ctx.dot_prec, tuning=ctx.tuning)
        dq, dk, dv, da, db = (g.view(x.shape) for g, x in zip(grads[:5], (q, k, v, a, b)))  # in their dtypes
        return dq, dk, dv, da, db, None, grads[5], None, None, None, None, None


def chunk_iplr_delta_rule_bwd_recompute(q, k, v, a, b, scale, initial_state, cu_seqlens, do, dht, *, dot_prec: str):
    """Gradients of (o, final_state) w.r.t. (q, k, v, a, b, initial_state) from scratch (the T solve included),
    the dots in dot_prec; the fused-recurrent path's backward. Returns (dq, dk, dv, da, db, dh0) in the inputs'
    dtypes."""
    _check_chunk_dims(q, v)
    B, T = q.shape[:2]
    layout = chunk_layout(B, T, cu_seqlens, CHUNK_SIZE, q.device)
    flat = [flatten_tokens(x) for x in (q, k, v, a, b)]
    _, _, (Ai, Ak) = chunk_iplr_delta_rule_fwd(*flat, scale, initial_state, False, layout, dot_prec=dot_prec)
    grads = chunk_iplr_delta_rule_bwd(*flat, scale, initial_state, Ai, Ak, flatten_tokens(do),
                                      None if dht is None else dht.contiguous(), layout, dot_prec=dot_prec)
    return (*(g.view(x.shape) for g, x in zip(grads[:5], (q, k, v, a, b))), grads[5])


def _check_chunk_dims(q, v):
    check_chunk_dims(q.shape[-1], v.shape[-1], "q/k/a/b")
    if q.is_cuda and q.dtype != torch.bfloat16 and q.shape[-1] > 128:
        raise ValueError(f"the chunked kernels take K > 128 only with bfloat16 inputs on a GPU, got K={q.shape[-1]} "
                         f"(q/k/a/b) in {q.dtype} (README.md, Limits: float32 tiles need more shared memory than an "
                         f"SM has, float16 ones gave wrong outputs); pass bfloat16 inputs or K <= 128")


def chunk_iplr_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    dot: str = "auto",
    *,
    chunk_size: int | None = CHUNK_SIZE,
    tuning: Tuning = DEFAULT_TUNING,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """IPLR delta rule S_t = S_{t−1} + b_t (a_tᵀ S_{t−1}) + k_t v_tᵀ, o_t = S_tᵀ (scale q_t), chunked (chunk_size
    16, 32 or 64, the default; None means 64, as fla's keyword), differentiable w.r.t. q, k, v, a, b and initial_state.

    q, k, a, b: [B, T, H, K]; v: [B, T, H, V]; scale: default K^-0.5; initial_state: [N, H, K, V] (fp32; N = B,
    or the number of sequences with cu_seqlens); cu_seqlens: [N+1] int offsets of packed sequences with B = 1.
    16 <= K <= 256, V >= 16. dot: auto | bf16 | tf32, the kernels' dots for bf16 inputs ("auto": bf16, with T, h,
    X and their gradients stored bf16; "tf32" stores them fp32: 6.35 against 3.94 ms forward+backward at H16
    K=V=128 B8 T2048 on H100, common/precision.py). tuning: the kernels' launch choices (common/tuning.py; the
    default is what ships), for tuning runs.
    Returns o [B, T, H, V] in v's dtype and the final state [N, H, K, V] fp32 (None unless output_final_state).
    Stable when b_t = λ_t a_t with λ_t ‖a_t‖² ∈ [−2, 0] (see README.md).
    """
    check_dot(dot)
    check_tuning(tuning)
    chunk_size = check_chunk_size(CHUNK_SIZE if chunk_size is None else chunk_size)
    _, scale = check_inputs(q, k, v, a, b, scale, initial_state, cu_seqlens)
    _check_chunk_dims(q, v)
    if q.dtype == torch.float64:
        # float64 is reference territory (gradient checks); Triton's GPU compiler rejects it in the solve, while the
        # naive recurrence computes exactly this function in float64.
        return naive_recurrent_iplr_delta_rule(q, k, v, a, b, scale, initial_state, output_final_state, cu_seqlens)
    if initial_state is not None and initial_state.dtype != torch.float32:
        initial_state = initial_state.float()
    return ChunkIPLRDeltaRuleFunction.apply(q, k, v, a, b, scale, initial_state, output_final_state, cu_seqlens,
                                            chunk_size, iplr_dot_precision(q.dtype, dot), tuning)


class FusedRecurrentIPLRDeltaRuleFunction(torch.autograd.Function):
    """Forward through the recurrent kernel; backward through the chunked backward (same maths, recomputed)."""

    @staticmethod
    def forward(ctx, q, k, v, a, b, scale, initial_state, output_final_state, cu_seqlens, dot_prec):
        o, ht = fused_recurrent_iplr_delta_rule_fwd(q, k, v, a, b, scale, initial_state, output_final_state,
                                                    cu_seqlens)
        ctx.save_for_backward(q, k, v, a, b, initial_state, cu_seqlens)
        ctx.scale, ctx.dot_prec = scale, dot_prec
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, a, b, initial_state, cu_seqlens = ctx.saved_tensors
        grads = chunk_iplr_delta_rule_bwd_recompute(q, k, v, a, b, ctx.scale, initial_state, cu_seqlens, do, dht,
                                                    dot_prec=ctx.dot_prec)
        return (*grads[:5], None, grads[5], None, None, None)


def fused_recurrent_iplr_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    dot: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """IPLR delta rule, token by token in one kernel (decoding: T = 1 with the cache state in and out).

    Same arguments, layout and returns as `chunk_iplr_delta_rule`: q, k, a, b [B, T, H, K]; v [B, T, H, V];
    initial_state [N, H, K, V] fp32; cu_seqlens [N+1] with B = 1; dot (auto | bf16 | tf32) for the backward.
    Returns (o, final_state). Differentiable (the backward runs the chunked backward kernels; needs 16 <= K <= 256,
    V >= 16).
    """
    check_dot(dot)
    _, scale = check_inputs(q, k, v, a, b, scale, initial_state, cu_seqlens)
    if initial_state is not None and initial_state.dtype != torch.float32:
        initial_state = initial_state.float()
    return FusedRecurrentIPLRDeltaRuleFunction.apply(q, k, v, a, b, scale, initial_state, output_final_state,
                                                     cu_seqlens, iplr_dot_precision(q.dtype, dot))
