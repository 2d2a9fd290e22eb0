"""Chunked gated delta rule for training and prefill: the autograd Function and the public function.

Forward kernels in chunk_fwd.py, backward kernels in chunk_bwd.py, the shared chunk machinery in ops/common/.
The backward stores only G (the fp32 chunk-local gate cumsum) and T = (I + A)⁻¹ from the forward and recomputes
w, u, the chunk states and δ (cheaper than keeping [chunks, HV, K, V] states alive between forward and backward).
use_qk_l2norm_in_kernel normalises q and k in fp32 with torch ops before the kernels (autograd differentiates it).
"""

from __future__ import annotations

import torch

from ..common.chunking import chunk_layout
from ..common.precision import check_dot, check_recurrence_dot, op_dot_precision, recurrence_dot_precision
from .chunk_bwd import chunk_gated_delta_rule_bwd
from .chunk_fwd import CHUNK_SIZE, chunk_gated_delta_rule_fwd
from .inputs import check_inputs, l2norm


def _flat(x: torch.Tensor) -> torch.Tensor:
    """[B, T, ...] → [B*T, ...], contiguous."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]).contiguous()


class ChunkGatedDeltaRuleFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, dot_prec,
                recurrence_prec):
        B, T, H, K = q.shape
        HV, V = v.shape[2], v.shape[3]
        layout = chunk_layout(B, T, cu_seqlens, CHUNK_SIZE, q.device)
        o, ht, G, Ai = chunk_gated_delta_rule_fwd(_flat(q), _flat(k), _flat(v), _flat(g), _flat(beta), scale,
                                                  initial_state, output_final_state, layout, dot_prec=dot_prec,
                                                  recurrence_prec=recurrence_prec)
        ctx.save_for_backward(q, k, v, beta, initial_state, G, Ai)
        ctx.layout, ctx.scale, ctx.g_dtype = layout, scale, g.dtype
        ctx.dot_prec, ctx.recurrence_prec = dot_prec, recurrence_prec
        return o.view(B, T, HV, V), ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, beta, initial_state, G, Ai = ctx.saved_tensors
        B, T = q.shape[:2]
        dq, dk, dv, dg, dbeta, dh0 = chunk_gated_delta_rule_bwd(
            _flat(q), _flat(k), _flat(v), _flat(beta), ctx.scale, initial_state, G, Ai, _flat(do),
            None if dht is None else dht.contiguous(), ctx.layout, dot_prec=ctx.dot_prec,
            recurrence_prec=ctx.recurrence_prec)
        shape = lambda x, like: x.view(like.shape).to(like.dtype)  # noqa: E731
        return (shape(dq, q), shape(dk, k), shape(dv, v), dg.view(B, T, -1).to(ctx.g_dtype), shape(dbeta, beta),
                None, dh0, None, None, None, None)


def chunk_gated_delta_rule_bwd_with_l2norm(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm,
                                           do, dht, *, dot_prec: str, recurrence_prec: str):
    """Gradients of (o, final_state) w.r.t. (q, k, v, g, beta, initial_state), recomputing the forward chunk
    pieces with the WY and state-pass kernels in `recurrence_prec`, the others in `dot_prec`; used by the
    fused-recurrent path's backward.
    Returns (dq, dk, dv, dg, dbeta, dh0)."""
    with torch.enable_grad():
        q0, k0 = q.detach().requires_grad_(use_qk_l2norm), k.detach().requires_grad_(use_qk_l2norm)
        qn, kn = (l2norm(q0), l2norm(k0)) if use_qk_l2norm else (q0, k0)
        B, T = q.shape[:2]
        layout = chunk_layout(B, T, cu_seqlens, CHUNK_SIZE, q.device)
        _, _, G, Ai = chunk_gated_delta_rule_fwd(_flat(qn.detach()), _flat(kn.detach()), _flat(v), _flat(g),
                                                 _flat(beta), scale, initial_state, False, layout,
                                                 dot_prec=dot_prec, recurrence_prec=recurrence_prec)
        dq, dk, dv, dg, dbeta, dh0 = chunk_gated_delta_rule_bwd(
            _flat(qn.detach()), _flat(kn.detach()), _flat(v), _flat(beta), scale, initial_state, G, Ai,
            _flat(do), None if dht is None else dht.contiguous(), layout, dot_prec=dot_prec,
            recurrence_prec=recurrence_prec)
        dq, dk = dq.view(q.shape).to(q.dtype), dk.view(k.shape).to(k.dtype)
        if use_qk_l2norm:
            dq, dk = torch.autograd.grad((qn, kn), (q0, k0), (dq, dk))
    return (dq, dk, dv.view(v.shape).to(v.dtype), dg.view(g.shape).to(g.dtype), dbeta.view(beta.shape).to(beta.dtype),
            dh0)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    recurrence_dot: str = "auto",
    dot: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule, chunked (chunk size 64), differentiable w.r.t. q, k, v, g, beta and initial_state.

    q, k: [B, T, H, K]; v: [B, T, HV, V] with HV a multiple of H (GVA); g (log gate, ≤ 0), beta: [B, T, HV];
    scale: default K^-0.5; initial_state: [N, HV, K, V] (fp32; N = B, or the number of sequences with
    cu_seqlens); cu_seqlens: [N+1] int offsets of packed sequences with B = 1. K ≤ 256.
    recurrence_dot: auto | bf16 | tf32, the dots of the kernels that carry the recurrence (WY and state passes,
    forward and backward) for bf16 inputs; "auto" is `dot`'s, "tf32" costs ~+28% forward+backward time for less
    rounding in the state. dot: auto | bf16 | tf32, the other chunk kernels' dots for bf16 inputs ("auto": bf16;
    "tf32" for every dot costs ~+36%; common/precision.py). fp32 and fp16 inputs ignore both.
    Returns o [B, T, HV, V] in v's dtype and the final state [N, HV, K, V] fp32 (None unless output_final_state).
    """
    check_recurrence_dot(recurrence_dot)
    check_dot(dot)
    _, _, scale = check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    if not 16 <= q.shape[-1] <= 256 or v.shape[-1] < 16:
        raise ValueError(f"the chunked kernels need 16 <= K <= 256 and V >= 16 (tl.dot tiles), got "
                         f"K={q.shape[-1]} (q/k) and V={v.shape[-1]} (v)")
    if q.dtype == torch.float64:
        # float64 is reference territory (gradient checks); Triton's GPU compiler rejects it in the solve, while the
        # naive recurrence computes exactly this function in float64.
        from rltrain_kernels.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

        return naive_recurrent_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state,
                                                cu_seqlens, use_qk_l2norm_in_kernel)
    if initial_state is not None and initial_state.dtype != torch.float32:
        initial_state = initial_state.float()
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    return ChunkGatedDeltaRuleFunction.apply(q, k, v, g, beta, scale, initial_state, output_final_state,
                                             cu_seqlens, op_dot_precision(q.dtype, dot),
                                             recurrence_dot_precision(q.dtype, recurrence_dot, dot))
