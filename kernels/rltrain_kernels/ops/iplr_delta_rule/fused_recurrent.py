"""Fused-recurrent IPLR delta rule: one Triton program per (sequence, head, V block) walks the tokens with the fp32
state tile in registers. Built for decoding (T = 1 with the cache state in and out) and short sequences.

Each state column evolves on its own (a_tᵀ S reads column by column), so V blocks are independent programs.
Backward: this path is forward-only by itself; when gradients are required its autograd Function delegates the
backward to the chunked kernels (`chunk.chunk_iplr_delta_rule_bwd_recompute`), which compute the same maths; the
forward values still come from this kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.precision import check_dot, iplr_dot_precision
from .inputs import check_inputs


@triton.jit
def fused_recurrent_iplr_fwd_kernel(
    q, k, v, a, b, o, h0, ht, cu_seqlens, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr,
):
    i_nh, i_v = tl.program_id(0), tl.program_id(1)  # sequences × heads on axis 0 (no 65535 limit)
    i_n, i_h = i_nh // H, i_nh % H
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k, mask_v = o_k < K, o_v < V
    mask_h = mask_k[:, None] & mask_v[None, :]
    state_offset = (i_n * H + i_h).to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]

    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_INITIAL_STATE:
        b_h += tl.load(h0 + state_offset, mask=mask_h, other=0.0).to(tl.float32)
    for t in range(bos, eos):
        p_k = (t * H + i_h) * K + o_k
        b_q = tl.load(q + p_k, mask=mask_k, other=0.0).to(tl.float32)
        b_k = tl.load(k + p_k, mask=mask_k, other=0.0).to(tl.float32)
        b_a = tl.load(a + p_k, mask=mask_k, other=0.0).to(tl.float32)
        b_b = tl.load(b + p_k, mask=mask_k, other=0.0).to(tl.float32)
        b_v = tl.load(v + (t * H + i_h) * V + o_v, mask=mask_v, other=0.0).to(tl.float32)
        b_read = tl.sum(b_h * b_a[:, None], 0)  # a_tᵀ S_{t−1}
        b_h += b_b[:, None] * b_read[None, :] + b_k[:, None] * b_v[None, :]
        b_o = tl.sum(b_h * (b_q * scale)[:, None], 0)
        tl.store(o + (t * H + i_h) * V + o_v, b_o.to(o.dtype.element_ty), mask=mask_v)
    if STORE_FINAL_STATE:
        tl.store(ht + state_offset, b_h, mask=mask_h)


def fused_recurrent_iplr_delta_rule_fwd(q, k, v, a, b, scale, initial_state, output_final_state, cu_seqlens):
    """Host function: flatten the batch, launch one program per (V block, sequence × head)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    # Only the sequence offsets are needed (built on the device, no host sync, for decoding).
    if cu_seqlens is None:
        offsets = torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=q.device) if T > 0 else \
            torch.zeros(B + 1, dtype=torch.int32, device=q.device)
    else:
        offsets = cu_seqlens.to(torch.int32).contiguous()  # read as a dense array, whatever the caller's view
    N = offsets.numel() - 1
    BK = triton.next_power_of_2(K)
    # BV=32 as in the gated delta rule's decode kernel: a [128, 32] fp32 tile is 16 registers/thread at 2 warps.
    BV = min(triton.next_power_of_2(V), 32)
    o = torch.empty(B, T, H, V, dtype=v.dtype, device=v.device)
    ht = torch.empty(N, H, K, V, dtype=torch.float32, device=q.device) if output_final_state else None
    h0 = initial_state.contiguous() if initial_state is not None else None
    if N * H > 0:
        fused_recurrent_iplr_fwd_kernel[(N * H, triton.cdiv(V, BV))](
            q.contiguous(), k.contiguous(), v.contiguous(), a.contiguous(), b.contiguous(), o, h0, ht, offsets,
            scale, H=H, K=K, V=V, BK=BK, BV=BV, USE_INITIAL_STATE=h0 is not None,
            STORE_FINAL_STATE=output_final_state, num_warps=2)
    return o, ht


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
        from .chunk import chunk_iplr_delta_rule_bwd_recompute

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
