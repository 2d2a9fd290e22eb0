"""KDA's public entry points and their autograd Functions: `chunk_kda` for training and prefill,
`fused_recurrent_kda` for decoding.

Chunked: forward kernels in chunk_fwd.py (with gate.py and intra.py), backward in chunk_bwd.py. The backward keeps
G (the fp32 chunk-local gate cumsum), T = (I + diag(β) Akk)⁻¹ and Aqk from the forward and recomputes the chunk
states and δ. use_qk_l2norm_in_kernel normalises q and k with the l2norm op before the kernels (autograd
differentiates it); use_beta_sigmoid_in_kernel is one torch sigmoid before them; use_gate_in_kernel runs gate.py's
kernels in place of the plain cumsum, so A_log and dt_bias get their gradients there; state_v_first transposes the
[N, HV, V, K] states at the boundary.

Fused recurrent: the forward is fused_recurrent.py's kernel (fla's keywords computed inside it); its backward
recomputes through chunk_kda under autograd (same maths).
"""

from __future__ import annotations

import torch

from ..common.chunking import CHUNK_SIZE, chunk_layout, flatten_tokens
from ..common.inputs import check_chunk_dims, check_chunk_size, resolve_state_v_first
from ..common.precision import check_dot, check_recurrence_dot, op_dot_precision, recurrence_dot_precision
from ..common.tuning import DEFAULT_TUNING, Tuning, check_tuning
from ..l2norm import l2norm
from .chunk_bwd import chunk_kda_bwd
from .chunk_fwd import chunk_kda_fwd
from .fused_recurrent import fused_recurrent_kda_fwd
from .inputs import check_inputs, check_preprocess
from .naive import naive_recurrent_kda


class ChunkKDAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state, cu_seqlens,
                chunk_size, dot_prec, recurrence_prec, tuning):
        B, T, H, K = q.shape
        HV, V = v.shape[2], v.shape[3]
        layout = chunk_layout(B, T, cu_seqlens, chunk_size, q.device)
        gate = None if A_log is None else (A_log, dt_bias)  # g is then the raw a (gate.py)
        o, ht, G, Ai, Aqk = chunk_kda_fwd(*map(flatten_tokens, (q, k, v, g, beta)), scale, initial_state,
                                          output_final_state, layout, gate, dot_prec=dot_prec,
                                          recurrence_prec=recurrence_prec, tuning=tuning)
        ctx.save_for_backward(q, k, v, beta, initial_state, G, Ai, Aqk, *((g, A_log, dt_bias) if gate else ()))
        ctx.layout, ctx.scale, ctx.g_dtype = layout, scale, g.dtype
        ctx.dot_prec, ctx.recurrence_prec, ctx.tuning = dot_prec, recurrence_prec, tuning
        return o.view(B, T, HV, V), ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, beta, initial_state, G, Ai, Aqk, *gate = ctx.saved_tensors
        if gate:
            gate[0] = flatten_tokens(gate[0])
        dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias = chunk_kda_bwd(
            *map(flatten_tokens, (q, k, v, beta)), ctx.scale, initial_state, G, Ai, Aqk, flatten_tokens(do),
            dht, ctx.layout, gate=gate or None, dot_prec=ctx.dot_prec, recurrence_prec=ctx.recurrence_prec,
            tuning=ctx.tuning)
        shape = lambda x, like: x.view(like.shape).to(like.dtype)  # noqa: E731
        return (shape(dq, q), shape(dk, k), shape(dv, v), dg.view(q.shape[:2] + dg.shape[1:]).to(ctx.g_dtype),
                shape(dbeta, beta), dA_log, ddt_bias, None, dh0, None, None, None, None, None, None)


def chunk_kda(
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
    """Kimi Delta Attention, chunked, differentiable w.r.t. q, k, v, g, beta, initial_state (and A_log, dt_bias).

    q, k: [B, T, H, K]; v: [B, T, HV, V] with HV a multiple of H (GVA); g (log decay per key channel, ≤ 0):
    [B, T, HV, K]; beta: [B, T, HV]; scale: default K^-0.5; initial_state: [N, HV, K, V] (fp32; N = B, or the
    number of sequences with cu_seqlens); cu_seqlens: [N+1] int offsets of packed sequences with B = 1. 16 ≤ K ≤ 256.
    recurrence_dot, dot: auto | bf16 | tf32, the dots of the kernels that carry the recurrence (intra-chunk solve,
    state passes) and of the others, for bf16 inputs (common/precision.py); fp32 and fp16 inputs ignore both.
    fla's keywords (keyword-only), with fla's meaning:
      use_gate_in_kernel: g is the raw a [B, T, HV, K] of g = −exp(A_log) softplus(a + dt_bias), computed inside
        (gate.py); A_log (required, HV values) and dt_bias (optional, HV·K values), ignored without it.
      use_beta_sigmoid_in_kernel: beta holds logits, β = sigmoid(beta) (2·sigmoid(beta) with allow_neg_eigval).
      state_v_first: initial_state and the final state are [N, HV, V, K]; transpose_state_layout: its old name.
      chunk_size: 16, 32 or 64 (the default).
    tuning: the kernels' launch choices (common/tuning.py). Returns o [B, T, HV, V] in v's dtype and the final
    state [N, HV, K, V] fp32 (None unless output_final_state).
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
        # float64 is reference territory (gradient checks): the naive recurrence computes this function exactly.
        return naive_recurrent_kda(
            q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm_in_kernel,
            use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
            state_v_first=state_v_first)
    if initial_state is not None:
        if state_v_first:  # a transposed view: the state pass reads it densely as [N, HV, K, V]
            initial_state = initial_state.transpose(-1, -2)
        if initial_state.dtype != torch.float32:
            initial_state = initial_state.float()
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if pre.beta_scale:
        beta = pre.beta_scale * torch.sigmoid(beta.float())
    A_log, dt_bias = pre.gate or (None, None)
    o, final_state = ChunkKDAFunction.apply(
        q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state, cu_seqlens, chunk_size,
        op_dot_precision(q.dtype, dot), recurrence_dot_precision(q.dtype, recurrence_dot, dot), tuning)
    if state_v_first and final_state is not None:
        final_state = final_state.transpose(-1, -2).contiguous()
    return o, final_state


class FusedRecurrentKDAFunction(torch.autograd.Function):
    """Forward through the recurrent kernel; backward by recomputing through chunk_kda (same maths) under autograd."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, initial_state, scale, output_final_state, cu_seqlens,
                keywords):
        gate = None if A_log is None else (A_log, dt_bias)
        o, ht = fused_recurrent_kda_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                                        keywords["use_qk_l2norm_in_kernel"], gate, keywords["beta_scale"],
                                        keywords["state_v_first"])
        ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens)
        ctx.scale, ctx.keywords = scale, keywords
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        *tensors, cu_seqlens = ctx.saved_tensors
        kw = ctx.keywords
        with torch.enable_grad():
            leaves = [None if t is None else t.detach().requires_grad_(need)
                      for t, need in zip(tensors, ctx.needs_input_grad)]
            q, k, v, g, beta, A_log, dt_bias, h0 = leaves
            o, ht = chunk_kda(q, k, v, g, beta, ctx.scale, h0, dht is not None, cu_seqlens,
                              kw["use_qk_l2norm_in_kernel"], kw["recurrence_dot"], kw["dot"],
                              use_gate_in_kernel=A_log is not None, A_log=A_log, dt_bias=dt_bias,
                              use_beta_sigmoid_in_kernel=bool(kw["beta_scale"]),
                              allow_neg_eigval=kw["beta_scale"] == 2.0, state_v_first=kw["state_v_first"])
            wanted = [t for t in leaves if t is not None and t.requires_grad]
            outputs, grads = ([o, ht], [do, dht]) if dht is not None else ([o], [do])
            found = iter(torch.autograd.grad(outputs, wanted, grads, allow_unused=True))
        return (*(next(found) if t is not None and t.requires_grad else None for t in leaves), None, None, None,
                None)


def fused_recurrent_kda(
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
    """KDA token by token in one kernel (decoding: T = 1 with the cache state in and out).

    Same arguments, layout and returns as `chunk_kda` (recurrence_dot and dot apply to the backward, which runs the
    chunked kernels); fla's keywords computed inside the kernel. No chunk_size (as fla's)."""
    check_recurrence_dot(recurrence_dot)
    check_dot(dot)
    state_v_first = resolve_state_v_first(state_v_first, transpose_state_layout)
    _, _, scale = check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first)
    pre = check_preprocess(g, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    if initial_state is not None and initial_state.dtype != torch.float32:
        initial_state = initial_state.float()
    A_log, dt_bias = pre.gate or (None, None)
    keywords = dict(use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, beta_scale=pre.beta_scale,
                    state_v_first=state_v_first, recurrence_dot=recurrence_dot, dot=dot)
    return FusedRecurrentKDAFunction.apply(q, k, v, g, beta, A_log, dt_bias, initial_state, scale,
                                           output_final_state, cu_seqlens, keywords)
