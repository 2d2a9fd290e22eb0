"""CUDA-event timing shared by the fused-loss benchmarks, in two modes:

    from idle : the GPU is idle when the call starts, so the host's work before its first kernel (argument checks,
                allocations, launch set-up) shows in the time, as for a call on its own;
    queued    : a ~10 ms spin kernel (torch.cuda._sleep) is queued first and the start event after it, so the
                call's host work overlaps GPU work, as it does inside a training step, where the model's forward
                is still running when the loss is called. What remains is the call's GPU time plus any wait the
                call itself forces (a device→host read).

Both modes time the same call; a floor is a GPU-time quantity, so ratios to it read best queued.

    from timing import median_ms
    ms = median_ms(step, queued=True)      # median over iters, after warmup calls
"""

from __future__ import annotations

import statistics

import torch

SPIN_CYCLES = 20_000_000    # ≥ 10 ms at the H100/H200's ≤ 1.98 GHz: longer than any call's host set-up here


def time_ms(step, queued: bool) -> float:
    """One call of step(), in ms between CUDA events; synchronizes before and after."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if queued:
        torch.cuda._sleep(SPIN_CYCLES)
    start.record()
    step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def median_ms(step, warmup: int = 2, iters: int = 7, queued: bool = True) -> float:
    for _ in range(warmup):
        step()
    return statistics.median(time_ms(step, queued) for _ in range(iters))
