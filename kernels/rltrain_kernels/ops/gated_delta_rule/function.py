"""The gated delta rule's public entry points and their autograd Functions: `chunk_gated_delta_rule` for training and
prefill, `fused_recurrent_gated_delta_rule` for decoding.

Chunked: forward kernels in chunk_fwd.py, backward in chunk_bwd.py, the shared chunk machinery in ops/common/. The
backward stores only G (the fp32 chunk-local gate cumsum) and T = (I + A)⁻¹ from the forward and recomputes w, u, the
chunk states and δ (cheaper than keeping [chunks, HV, K, V] states alive between forward and backward).
use_qk_l2norm_in_kernel normalises q and k in fp32 with torch ops before the kernels (autograd differentiates it).
fla's keywords: use_gate_in_kernel runs gate.py's kernels in place of the gate cumsum (forward) and its reverse
(backward), so A_log and dt_bias get their gradients there; use_beta_sigmoid_in_kernel is one torch sigmoid before the
kernels (the pass a caller would make); state_v_first transposes the [N, HV, V, K] states at the boundary (a
transposed view in, a contiguous copy out: the state pass keeps its [K, V] tiles).

Fused recurrent: the forward is fused_recurrent.py's kernel (fla's keywords computed inside it); the path is
forward-only by itself, so its backward recomputes through the chunked kernels (chunk_gated_delta_rule_bwd_recompute:
same maths); `recurrence_dot` is that backward's (the forward runs no dots).
"""

from __future__ import annotations

import torch

from ..common.chunking import CHUNK_SIZE, chunk_layout, flatten_tokens
from ..common.inputs import check_chunk_dims, check_chunk_size, resolve_state_v_first
from ..common.precision import check_dot, check_recurrence_dot, op_dot_precision, recurrence_dot_precision
from ..common.tuning import DEFAULT_TUNING, Tuning, check_tuning
from ..l2norm import l2norm
from .chunk_bwd import chunk_gated_delta_rule_bwd
from .chunk_fwd import chunk_gated_delta_rule_fwd
from .fused_recurrent import fused_recurrent_gated_delta_rule_fwd
from .inputs import check_inputs, check_preprocess
from .naive import naive_recurrent_gated_delta_rule


class ChunkGatedDeltaRuleFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state, cu_seqlens,
                chunk_size, dot_prec, recurrence_prec, tuning):
        B, T, H, K = q.shape
        HV, V = v.shape[2], v.shape[3]
        layout = chunk_layout(B, T, cu_seqlens, chunk_size, q.device)
        gate = None if A_log is None else (A_log, dt_bias)  # g is then the raw a (gate.py)
        o, ht, G, Ai = chunk_gated_delta_rule_fwd(*map(flatten_tokens, (q, k, v, g, beta)), scale, initial_state,
                                                  output_final_state, layout, gate, dot_prec=dot_prec,
                                                  recurrence_prec=recurrence_prec, tuning=tuning)
        ctx.save_for_backward(q, k, v, beta, initial_state, G, Ai, *((g, A_log, dt_bias) if gate else ()))
        ctx.layout, ctx.scale, ctx.g_dtype = layout, scale, g.dtype
        ctx.dot_prec, ctx.recurrence_prec, ctx.tuning = dot_prec, recurrence_prec, tuning
        return o.view(B, T, HV, V), ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, beta, initial_state, G, Ai, *gate = ctx.saved_tensors
        B, T = q.shape[:2]
        if gate:
            gate[0] = flatten_tokens(gate[0])
        dq, dk, dv, dg, dbeta, dh0, gate_grads = chunk_gated_delta_rule_bwd(
            *map(flatten_tokens, (q, k, v, beta)), ctx.scale, initial_state, G, Ai, flatten_tokens(do),
            None if dht is None else dht.contiguous(), ctx.layout, gate=gate or None, dot_prec=ctx.dot_prec,
            recurrence_prec=ctx.recurrence_prec, tuning=ctx.tuning)
        dA_log, ddt_bias = gate_grads or (None, None)
        shape = lambda x, like: x.view(like.shape).to(like.dtype)  # noqa: E731
        return (shape(dq, q), shape(dk, k), shape(dv, v), dg.view(B, T, -1).to(ctx.g_dtype), shape(dbeta, beta),
                dA_log, ddt_bias, None, dh0, None, None, None, None, None, None)


def chunk_gated_delta_rule_bwd_recompute(q, k, v, g, beta, scale, initial_state, cu_seqlens, do, dht, *,
                                         use_qk_l2norm: bool, gate, beta_scale: float, state_v_first: bool,
                                         dot_prec: str, recurrence_prec: str):
    """Gradients of (o, final_state) w.r.t. (q, k, v, g, beta, initial_state, A_log, dt_bias) of the op with its
    preprocessing (l2norm of q, k; gate: (A_log, dt_bias) making g from the raw a, or None; beta_scale: β =
    beta_scale·sigmoid(beta), or 0; state_v_first: [N, HV, V, K] states), recomputing the forward chunk pieces with
    the WY and state-pass kernels in `recurrence_prec`, the others in `dot_prec`; used by the fused-recurrent path's
    backward. Returns (dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias), the last two None without a gate."""
    with torch.enable_grad():
        q0, k0 = q.detach().requires_grad_(use_qk_l2norm), k.detach().requires_grad_(use_qk_l2norm)
        qn, kn = (l2norm(q0), l2norm(k0)) if use_qk_l2norm else (q0, k0)
        beta0 = beta.detach().requires_grad_(bool(beta_scale))
        beta_n = beta_scale * torch.sigmoid(beta0.float()) if beta_scale else beta0
    if state_v_first:
        initial_state = None if initial_state is None else initial_state.transpose(-1, -2).contiguous()
        dht = None if dht is None else dht.transpose(-1, -2)
    B, T = q.shape[:2]
    layout = chunk_layout(B, T, cu_seqlens, CHUNK_SIZE, q.device)
    flat = [flatten_tokens(x.detach()) for x in (qn, kn, v, g, beta_n)]
    _, _, G, Ai = chunk_gated_delta_rule_fwd(*flat, scale, initial_state, False, layout, gate,
                                             dot_prec=dot_prec, recurrence_prec=recurrence_prec)
    dq, dk, dv, dg, dbeta, dh0, gate_grads = chunk_gated_delta_rule_bwd(
        flat[0], flat[1], flat[2], flat[4], scale, initial_state, G, Ai, flatten_tokens(do),
        None if dht is None else dht.contiguous(), layout, gate=None if gate is None else (flat[3], *gate),
        dot_prec=dot_prec, recurrence_prec=recurrence_prec)
    dq, dk = dq.view(q.shape).to(q.dtype), dk.view(k.shape).to(k.dtype)
    if use_qk_l2norm:
        dq, dk = torch.autograd.grad((qn, kn), (q0, k0), (dq, dk))
    dbeta = dbeta.view(beta.shape)
    if beta_scale:
        dbeta, = torch.autograd.grad(beta_n, beta0, dbeta.to(beta_n.dtype))
    if state_v_first and dh0 is not None:
        dh0 = dh0.transpose(-1, -2).contiguous()
    dA_log, ddt_bias = gate_grads or (None, None)
    return (dq, dk, dv.view(v.shape).to(v.dtype), dg.view(g.shape).to(g.dtype), dbeta.to(beta.dtype), dh0,
            dA_log, ddt_bias)


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
    *,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    chunk_size: int = CHUNK_SIZE,
    transpose_state_layout: bool | None = None,
    tuning: Tuning = DEFAULT_TUNING,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule, chunked, differentiable w.r.t. q, k, v, g, beta, initial_state (and A_log, dt_bias).

    q, k: [B, T, H, K]; v: [B, T, HV, V] with HV a multiple of H (GVA); g (log gate, ≤ 0), beta: [B, T, HV];
    scale: default K^-0.5; initial_state: [N, HV, K, V] (fp32; N = B, or the number of sequences with
    cu_seqlens); cu_seqlens: [N+1] int offsets of packed sequences with B = 1. K ≤ 256.
    recurrence_dot: auto | bf16 | tf32, the dots of the kernels that carry the recurrence (WY and state passes,
    forward and backward) for bf16 inputs; "auto" is `dot`'s, "tf32" costs ~+28% forward+backward time for less
    rounding in the state. dot: auto | bf16 | tf32, the other chunk kernels' dots for bf16 inputs ("auto": bf16;
    "tf32" for every dot costs ~+36%; common/precision.py). fp32 and fp16 inputs ignore both.
    fla's keywords (keyword-only), with fla's meaning:
      use_gate_in_kernel: g is the raw a [B, T, HV] of Qwen3-Next's gate g = −exp(A_log) softplus(a + dt_bias),
        computed inside (gate.py); A_log (required) and dt_bias (optional): HV values each, ignored without it.
      use_beta_sigmoid_in_kernel: beta holds logits, β = sigmoid(beta) (2·sigmoid(beta) with allow_neg_eigval,
        which needs it).
      state_v_first: initial_state and the final state are [N, HV, V, K] (inference engines' layout);
        transpose_state_layout is its deprecated name.
      chunk_size: 16, 32 or 64 (the default, the one the kernels are tuned and timed at).
    tuning: the kernels' launch choices (common/tuning.py; the default is what ships), for tuning runs.
    Returns o [B, T, HV, V] in v's dtype and the final state [N, HV, K, V] fp32 (None unless output_final_state).
    """
    check_recurrence_dot(recurrence_dot)
    check_dot(dot)
    check_tuning(tuning)
    state_v_first = resolve_state_v_first(state_v_first, transpose_state_layout)
    chunk_size = check_chunk_size(chunk_size)
    _, _, scale = check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first)
    pre = check_preprocess(g, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    check_chunk_dims(q.shape[-1], v.shape[-1], "q/k")
    if q.dtype == torch.float64:
        # float64 is reference territory (gradient checks); Triton's GPU compiler rejects it in the solve, while the
        # naive recurrence computes exactly this function in float64.
        return naive_recurrent_gated_delta_rule(
            q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm_in_kernel,
            use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
            state_v_first=state_v_first)
    if initial_state is not None:
        if state_v_first:  # a transposed view: the state pass reads it densely (contiguous) as [N, HV, K, V]
            initial_state = initial_state.transpose(-1, -2)
        if initial_state.dtype != torch.float32:
            initial_state = initial_state.float()
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if pre.beta_scale:
        beta = torch.sigmoid(beta.float())
        if pre.beta_scale != 1.0:
            beta = beta * pre.beta_scale
    A_log, dt_bias = pre.gate or (None, None)
    o, final_state = ChunkGatedDeltaRuleFunction.apply(
        q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state, cu_seqlens, chunk_size,
        op_dot_precision(q.dtype, dot), recurrence_dot_precision(q.dtype, recurrence_dot, dot), tuning)
    if state_v_first and final_state is not None:
        final_state = final_state.transpose(-1, -2).contiguous()
    return o, final_state


class FusedRecurrentGatedDeltaRuleFunction(torch.autograd.Function):
    """Forward through the recurrent kernel; backward through the chunked backward (same maths, recomputed)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state, cu_seqlens,
                use_qk_l2norm, beta_scale, state_v_first, dot_prec, recurrence_prec):
        gate = None if A_log is None else (A_log, dt_bias)
        o, ht = fused_recurrent_gated_delta_rule_fwd(q, k, v, g, beta, scale, initial_state, output_final_state,
                                                     cu_seqlens, use_qk_l2norm, gate, beta_scale, state_v_first)
        ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens)
        ctx.scale, ctx.use_qk_l2norm, ctx.beta_scale, ctx.state_v_first = scale, use_qk_l2norm, beta_scale, \
            state_v_first
        ctx.dot_prec, ctx.recurrence_prec = dot_prec, recurrence_prec
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens = ctx.saved_tensors
        dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias = chunk_gated_delta_rule_bwd_recompute(
            q, k, v, g, beta, ctx.scale, initial_state, cu_seqlens, do, dht, use_qk_l2norm=ctx.use_qk_l2norm,
            gate=None if A_log is None else (A_log, dt_bias), beta_scale=ctx.beta_scale,
            state_v_first=ctx.state_v_first, dot_prec=ctx.dot_prec, recurrence_prec=ctx.recurrence_prec)
        return dq, dk, dv, dg, dbeta, dA_log, ddt_bias, None, dh0, None, None, None, None, None, None, None


def fused_recurrent_gated_delta_rule(
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
    *,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    transpose_state_layout: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule, token by token in one kernel (decoding: T = 1 with the cache state in and out).

    Same arguments, layout and returns as `chunk_gated_delta_rule`: q, k [B, T, H, K]; v [B, T, HV, V];
    g, beta [B, T, HV]; initial_state [N, HV, K, V] fp32; cu_seqlens [N+1] with B = 1; recurrence_dot and dot (auto |
    bf16 | tf32) for the backward, which runs the chunked kernels; fla's keywords use_gate_in_kernel (A_log,
    dt_bias), use_beta_sigmoid_in_kernel (allow_neg_eigval) and state_v_first (transpose_state_layout), computed
    inside the kernel. No chunk_size (as fla's). Returns (o, final_state).
    """
    check_recurrence_dot(recurrence_dot)
    check_dot(dot)
    state_v_first = resolve_state_v_first(state_v_first, transpose_state_layout)
    _, _, scale = check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first)
    pre = check_preprocess(g, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    if initial_state is not None and initial_state.dtype != torch.float32:
        initial_state = initial_state.float()
    A_log, dt_bias = pre.gate or (None, None)
    return FusedRecurrentGatedDeltaRuleFunction.apply(q, k, v, g, beta, A_log, dt_bias, scale, initial_state,
                                                      output_final_state, cu_seqlens, use_qk_l2norm_in_kernel,
                                                      pre.beta_scale, state_v_first,
                                                      op_dot_precision(q.dtype, dot),
                                                      recurrence_dot_precision(q.dtype, recurrence_dot, dot))
