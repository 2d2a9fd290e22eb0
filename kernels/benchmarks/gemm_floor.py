"""The GEMMs a fused linear + loss op cannot avoid, run bare (cuBLAS, bf16 out, nothing else), timed the same way
as the op: a *measured* floor next to the computed one (2·N·H·V flops per GEMM at the rate of a short 8192³
burst). Under the sustained load of a benchmark loop the card may clock lower than in that burst; the ratio of an
op to these bare GEMMs is its own overhead (row passes, launches, host work), free of that effect.

    from gemm_floor import bare_gemms, gemm_rates
    fn = bare_gemms(recompute=True)     # linear_logprobs: logits, then logits again + grad_hidden + grad_weight
    out = fn(hidden2d, weight); out.backward(torch.ones_like(out))
    burst, sustained = gemm_rates()     # flop/s of an 8192³ GEMM at boost clock / at the power limit
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


def gemm_rates(n: int = 8192, burst_iters: int = 20, sustain_s: float = 2.0) -> tuple[float, float]:
    """(burst, sustained) bf16 flop/s of an n³ torch.matmul on this GPU, the computed floors' rates.

    burst: the median of single GEMMs queued after a short warm-up — the card at its boost clock. The floor ratios
    the benchmarks print first use it. sustained: GEMMs timed after `sustain_s` of back-to-back GEMMs — the card at
    its power limit (H100 SXM: 700 W; SM clocks seen between 1.23 and 1.98 GHz through a benchmark loop, RESULTS.md
    2026-11-24), which is where a loop of multi-second timings runs. The benchmarks print ratios to both."""
    from timing import median_ms

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    flops = 2 * n**3
    burst = flops / (median_ms(lambda: a @ b, warmup=3, iters=burst_iters, queued=True) * 1e-3)
    reps = max(1, int(sustain_s * burst / flops))
    timed = min(50, reps)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for i in range(reps):
        if i == reps - timed:
            start.record()
        a @ b
    end.record()
    end.synchronize()
    return burst, flops * timed / (start.elapsed_time(end) * 1e-3)
