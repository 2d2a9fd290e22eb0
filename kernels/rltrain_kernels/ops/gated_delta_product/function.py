"""The gated delta product's public entry points and their autograd Functions: `chunk_gated_delta_product` for
training and prefill, `fused_recurrent_gated_delta_product` for decoding.

Chunked: the gated delta rule's chunk machinery (ops/common) run over the expanded axis of T·n_h Householder
sub-steps (README.md): the log gate g_t sits at each token's first sub-step (0 elsewhere), the query q_t at each
token's last sub-step, sequences are offset by cu_seqlens·n_h. Forward (chunk_fwd.py): gate cumsum → WY → state pass
(on k, v, beta as given) → the strided output pass (only the query rows, q and o of length T). Backward (chunk_bwd.py):
the chunked backward shared with the gated delta rule (common/chunk_bwd.py) on the expanded sequence with a query
stride of n_h, then dg gathered from the first sub-steps. Saved from the forward: G and T only (as the gated delta
rule). With n_h = 1 there is no expansion: the op is `chunk_gated_delta_rule` itself.

Fused recurrent: the forward is fused_recurrent.py's kernel; the path is forward-only by itself, so its backward
recomputes through the chunked path (same maths) and differentiates that; `recurrence_dot` is that backward's.
"""

from __future__ import annotations

import torch

from ..common.chunking import CHUNK_SIZE, chunk_layout, flatten_tokens
from ..common.inputs import check_chunk_dims
from ..common.precision import check_dot, check_recurrence_dot, op_dot_precision, recurrence_dot_precision
from ..common.tuning import DEFAULT_TUNING, Tuning, check_tuning
from ..gated_delta_rule import chunk_gated_delta_rule
from ..l2norm import l2norm
from .chunk_bwd import chunk_gated_delta_product_bwd
from .chunk_fwd import chunk_gated_delta_product_fwd, to_first_substep
from .fused_recurrent import fused_recurrent_gated_delta_product_fwd
from .inputs import check_inputs
from .naive import naive_recurrent_gated_delta_product


class ChunkGatedDeltaProductFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, num_householder, scale, initial_state, output_final_state, cu_seqlens,
                dot_prec, recurrence_prec, tuning):
        B, T, H, K = q.shape
        HV, V = v.shape[2], v.shape[3]
        n_h = num_householder
        layout = chunk_layout(B, T, cu_seqlens, CHUNK_SIZE, q.device, steps=n_h)
        g_sub = to_first_substep(g, n_h) if g is not None else beta.new_zeros(beta.shape, dtype=torch.float32)
        o, ht, G, Ai = chunk_gated_delta_product_fwd(*map(flatten_tokens, (q, k, v, g_sub, beta)), scale, n_h,
                                                     initial_state, output_final_state, layout, v.dtype,
                                                     dot_prec=dot_prec, recurrence_prec=recurrence_prec,
                                                     tuning=tuning)
        ctx.save_for_backward(q, k, v, beta, initial_state, G, Ai)
        ctx.layout, ctx.scale, ctx.num_householder = layout, scale, n_h
        ctx.dot_prec, ctx.recurrence_prec, ctx.tuning = dot_prec, recurrence_prec, tuning
        ctx.g_dtype = None if g is None else g.dtype
        return o.view(B, T, HV, V), ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, beta, initial_state, G, Ai = ctx.saved_tensors
        B, T, H, K = q.shape
        n_h = ctx.num_householder
        dq, dk, dv, dg, dbeta, dh0 = chunk_gated_delta_product_bwd(
            *map(flatten_tokens, (q, k, v, beta)), ctx.scale, n_h, initial_state, G, Ai, flatten_tokens(do),
            None if dht is None else dht.contiguous(), ctx.layout, dot_prec=ctx.dot_prec,
            recurrence_prec=ctx.recurrence_prec, tuning=ctx.tuning)
        dq = dq.view(B, T, H, K).to(q.dtype)
        dg = None if ctx.g_dtype is None else dg.view(B, T, n_h, -1)[:, :, 0].to(ctx.g_dtype)
        return (dq, dk.view(k.shape).to(k.dtype), dv.view(v.shape).to(v.dtype), dg,
                dbeta.view(beta.shape).to(beta.dtype), None, None, dh0, None, None, None, None, None)


def chunk_gated_delta_product(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor,
    num_householder: int,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    recurrence_dot: str = "auto",
    dot: str = "auto",
    *,
    tuning: Tuning = DEFAULT_TUNING,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta product, chunked, differentiable w.r.t. q, k, v, g, beta and initial_state.

    q: [B, T, H, K]; k: [B, T·n_h, H, K]; v: [B, T·n_h, HV, V]; beta: [B, T·n_h, HV] (row t·n_h + j is
    sub-step j of token t); g (log gate, ≤ 0): [B, T, HV] or None (no decay); scale: default K^-0.5;
    initial_state: [N, HV, K, V] fp32; cu_seqlens: [N+1] token offsets of q with B = 1. 16 ≤ K ≤ 256, V ≥ 16.
    recurrence_dot: auto | bf16 | tf32, the dots of the WY and state-pass kernels for bf16 inputs, as
    chunk_gated_delta_rule's (with β up to 2 and no decay "tf32" takes the outputs' error from 5.6e-3 to 3.5e-3);
    dot: auto | bf16 | tf32, the other chunk kernels' dots, as chunk_gated_delta_rule's.
    tuning: the kernels' launch choices (common/tuning.py; the default is what ships), for tuning runs.
    Returns o [B, T, HV, V] in v's dtype and the final state [N, HV, K, V] fp32 (None unless output_final_state).
    """
    check_recurrence_dot(recurrence_dot)
    check_dot(dot)
    check_tuning(tuning)
    _, _, scale = check_inputs(q, k, v, g, beta, num_householder, scale, initial_state, cu_seqlens)
    if num_householder == 1:  # no expansion: this is the gated delta rule itself
        if g is None:
            g = beta.new_zeros(beta.shape)
        return chunk_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                                      use_qk_l2norm_in_kernel, recurrence_dot, dot, tuning=tuning)
    check_chunk_dims(q.shape[-1], v.shape[-1], "q/k")
    if q.dtype == torch.float64:
        # float64 is reference territory (gradient checks): the naive recurrence computes exactly this function.
        return naive_recurrent_gated_delta_product(q, k, v, g, beta, num_householder, scale, initial_state,
                                                   output_final_state, cu_seqlens, use_qk_l2norm_in_kernel)
    if initial_state is not None and initial_state.dtype != torch.float32:
        initial_state = initial_state.float()
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    return ChunkGatedDeltaProductFunction.apply(q, k, v, g, beta, num_householder, scale, initial_state,
                                                output_final_state, cu_seqlens, op_dot_precision(q.dtype, dot),
                                                recurrence_dot_precision(q.dtype, recurrence_dot, dot), tuning)


class FusedRecurrentGatedDeltaProductFunction(torch.autograd.Function):
    """Forward through the recurrent kernel; backward by differentiating the chunked path (recomputed)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, num_householder, scale, initial_state, output_final_state, cu_seqlens,
                use_qk_l2norm, recurrence_dot, dot):
        o, ht = fused_recurrent_gated_delta_product_fwd(q, k, v, g, beta, num_householder, scale, initial_state,
                                                        output_final_state, cu_seqlens, use_qk_l2norm)
        ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens)
        ctx.num_householder, ctx.scale, ctx.use_qk_l2norm = num_householder, scale, use_qk_l2norm
        ctx.output_final_state, ctx.recurrence_dot, ctx.dot = output_final_state, recurrence_dot, dot
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, initial_state, cu_seqlens = ctx.saved_tensors
        inputs = [None if t is None else t.detach().requires_grad_() for t in (q, k, v, g, beta, initial_state)]
        with torch.enable_grad():
            o, ht = chunk_gated_delta_product(*inputs[:5], ctx.num_householder, ctx.scale, inputs[5],
                                              ctx.output_final_state, cu_seqlens, ctx.use_qk_l2norm,
                                              ctx.recurrence_dot, ctx.dot)
            outputs, grads = [o], [do]
            if ht is not None and dht is not None:
                outputs.append(ht)
                grads.append(dht)
            wrt = [t for t in inputs if t is not None]
            computed = iter(torch.autograd.grad(outputs, wrt, grads, allow_unused=True))
        dq, dk, dv, dg, dbeta, dh0 = (None if t is None else next(computed) for t in inputs)
        return dq, dk, dv, dg, dbeta, None, None, dh0, None, None, None, None, None


def fused_recurrent_gated_delta_product(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor,
    num_householder: int,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    recurrence_dot: str = "auto",
    dot: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta product, token by token in one kernel (decoding: T = 1 with the cache state in and out).

    Same arguments, layout and returns as `chunk_gated_delta_product`: q [B, T, H, K]; k [B, T·n_h, H, K];
    v [B, T·n_h, HV, V]; beta [B, T·n_h, HV]; g [B, T, HV] or None; initial_state [N, HV, K, V] fp32;
    cu_seqlens [N+1] token offsets of q with B = 1; recurrence_dot and dot (auto | bf16 | tf32) for the backward,
    which runs the chunked kernels. Returns (o [B, T, HV, V], final_state or None).
    """
    check_recurrence_dot(recurrence_dot)
    check_dot(dot)
    _, _, scale = check_inputs(q, k, v, g, beta, num_householder, scale, initial_state, cu_seqlens)
    if initial_state is not None and initial_state.dtype != torch.float32:
        initial_state = initial_state.float()
    return FusedRecurrentGatedDeltaProductFunction.apply(q, k, v, g, beta, num_householder, scale, initial_state,
                                                         output_final_state, cu_seqlens, use_qk_l2norm_in_kernel,
                                                         recurrence_dot, dot)
