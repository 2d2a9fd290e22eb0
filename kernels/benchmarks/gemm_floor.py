"""The GEMMs a fused linear + loss op cannot avoid, run bare (cuBLAS, bf16 out, nothing else), timed the same way
as the op: a *measured* floor next to the computed one (2·N·H·V flops per GEMM at the rate of a short 8192³
burst). Under the sustained load of a benchmark loop the card may clock lower than in that burst; the ratio of an
op to these bare GEMMs is its own overhead (row passes, launches, host work), free of that effect.

    from gemm_floor import bare_gemms
    fn = bare_gemms(recompute=True)     # linear_logprobs: logits, then logits again + grad_hidden + grad_weight
    out = fn(hidden2d, weight); out.backward(torch.ones_like(out))
"""

from __future__ import annotations

import torch


class _BareGemms(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, recompute):
        logits = hidden @ weight.t()                     # GEMM 1 (bf16 out: the logits themselves)
        ctx.save_for_backward(hidden, weight, None if recompute else logits)
        ctx.recompute = recompute
        return logits.new_zeros(hidden.shape[0])         # a stand-in output with a gradient path

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, logits = ctx.saved_tensors
        if ctx.recompute:
            logits = hidden @ weight.t()                 # GEMM 2 (the recompute of a 4-GEMM design)
        # the logits stand in for dlogits: same shape and dtype, random-like values (never zeros)
        return logits @ weight, logits.t() @ hidden, None


def bare_gemms(recompute: bool):
    """fn(hidden [N, H], weight [V, H]) → [N]; forward + backward run 3 GEMMs (4 with recompute)."""
    return lambda hidden, weight: _BareGemms.apply(hidden, weight, recompute)
