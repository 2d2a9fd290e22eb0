"""Fused-recurrent gated delta rule: one Triton program per (sequence, value head, V block) walks the tokens with
the fp32 state tile in registers. Built for decoding (T = 1 with the cache state in and out) and short sequences.

Backward: this path is forward-only by itself. When gradients are required, its autograd Function delegates the
backward to the chunked kernels (`chunk.chunk_gated_delta_rule_bwd`), which compute the same maths; the forward
values still come from this kernel. `recurrence_dot` is that backward's (the forward runs no dots).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.precision import check_dot, check_recurrence_dot, op_dot_precision, recurrence_dot_precision
from .inputs import check_inputs


@triton.jit
def fused_recurrent_gated_delta_rule_fwd_kernel(
    q, k, v, g, beta, o, h0, ht, cu_seqlens, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr, USE_QK_L2NORM: tl.constexpr,
):
    i_nh, i_v = tl.program_id(0), tl.program_id(1)  # sequences × heads on axis 0 (no 65535 limit)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k, mask_v = o_k < K, o_v < V
    mask_h = mask_k[:, None] & mask_v[None, :]
    state_offset = (i_n * HV + i_hv).to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]

    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_INITIAL_STATE:
        b_h += tl.load(h0 + state_offset, mask=mask_h, other=0.0).to(tl.float32)
    for t in range(bos, eos):
        b_q = tl.load(q + (t * H + i_h) * K + o_k, mask=mask_k, other=0.0).to(tl.float32)
        b_k = tl.load(k + (t * H + i_h) * K + o_k, mask=mask_k, other=0.0).to(tl.float32)
        b_v = tl.load(v + (t * HV + i_hv) * V + o_v, mask=mask_v, other=0.0).to(tl.float32)
        b_g = tl.load(g + t * HV + i_hv).to(tl.float32)
        b_beta = tl.load(beta + t * HV + i_hv).to(tl.float32)
        if USE_QK_L2NORM:
            b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6)
            b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
        b_h *= tl.exp(b_g)
        # delta = β (v − Sᵀ k): what the decayed state is missing for key k.
        b_delta = b_beta * (b_v - tl.sum(b_h * b_k[:, None], 0))
        b_h += b_k[:, None] * b_delta[None, :]
        b_o = tl.sum(b_h * (b_q * scale)[:, None], 0)
        tl.store(o + (t * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=mask_v)
    if STORE_FINAL_STATE:
        tl.store(ht + state_offset, b_h, mask=mask_h)


def fused_recurrent_gated_delta_rule_fwd(q, k, v, g, beta, scale, initial_state, output_final_state,
                                         cu_seqlens, use_qk_l2norm_in_kernel):
    """Host function: flatten the batch, launch one program per (V block, sequence × value head)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    # No chunk layout needed here: only the sequence offsets (built on the device, no host sync, for decoding).
    if cu_seqlens is None:
        offsets = torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=q.device) if T > 0 else \
            torch.zeros(B + 1, dtype=torch.int32, device=q.device)
    else:
        offsets = cu_seqlens.to(torch.int32).contiguous()  # read as a dense array, whatever the caller's view
    N = offsets.numel() - 1
    BK = triton.next_power_of_2(K)
    # BV=32 keeps the [BK, BV] fp32 tile at 16 registers/thread for K=128 with 2 warps and gives B·HV·V/32
    # programs (16k at B=256, HV=16, V=128) to cover the GPU; untuned on the device, see the benchmark's sweep.
    BV = min(triton.next_power_of_2(V), 32)
    o = torch.empty(B, T, HV, V, dtype=v.dtype, device=v.device)
    ht = torch.empty(N, HV, K, V, dtype=torch.float32, device=q.device) if output_final_state else None
    h0 = initial_state.contiguous() if initial_state is not None else None
    grid = (N * HV, triton.cdiv(V, BV))
    fused_recurrent_gated_delta_rule_fwd_kernel[grid](
        q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(), o, h0, ht,
        offsets, scale, H=H, HV=HV, K=K, V=V, BK=BK, BV=BV,
        USE_INITIAL_STATE=h0 is not None, STORE_FINAL_STATE=output_final_state,
        USE_QK_L2NORM=use_qk_l2norm_in_kernel, num_warps=2,
    )
    return o, ht


class FusedRecurrentGatedDeltaRuleFunction(torch.autograd.Function):
    """Forward through the recurrent kernel; backward through the chunked backward (same maths, recomputed)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm,
                dot_prec, recurrence_prec):
        o, ht = fused_recurrent_gated_delta_rule_fwd(q, k, v, g, beta, scale, initial_state, output_final_state,
                                                     cu_seqlens, use_qk_l2norm)
        ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens)
        ctx.scale, ctx.use_qk_l2norm = scale, use_qk_l2norm
        ctx.dot_prec, ctx.recurrence_prec = dot_prec, recurrence_prec
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        from .chunk import chunk_gated_delta_rule_bwd_with_l2norm

        q, k, v, g, beta, initial_state, cu_seqlens = ctx.saved_tensors
        dq, dk, dv, dg, dbeta, dh0 = chunk_gated_delta_rule_bwd_with_l2norm(
            q, k, v, g, beta, ctx.scale, initial_state, cu_seqlens, ctx.use_qk_l2norm, do, dht,
            dot_prec=ctx.dot_prec, recurrence_prec=ctx.recurrence_prec)
        return dq, dk, dv, dg, dbeta, None, dh0, None, None, None, None, None


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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule, token by token in one kernel (decoding: T = 1 with the cache state in and out).

    Same arguments, layout and returns as `chunk_gated_delta_rule`: q, k [B, T, H, K]; v [B, T, HV, V];
    g, beta [B, T, HV]; initial_state [N, HV, K, V] fp32; cu_seqlens [N+1] with B = 1; recurrence_dot and dot (auto |
    bf16 | tf32) for the backward, which runs the chunked kernels. Returns (o, final_state).
    """
    check_recurrence_dot(recurrence_dot)
    check_dot(dot)
    _, _, scale = check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    if initial_state is not None and initial_state.dtype != torch.float32:
        initial_state = initial_state.float()
    return FusedRecurrentGatedDeltaRuleFunction.apply(q, k, v, g, beta, scale, initial_state, output_final_state,
                                                      cu_seqlens, use_qk_l2norm_in_kernel,
                                                      op_dot_precision(q.dtype, dot),
                                                      recurrence_dot_precision(q.dtype, recurrence_dot, dot))
