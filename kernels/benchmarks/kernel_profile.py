"""Per-kernel GPU time of one call (torch.profiler, CUDA kernel time summed by kernel name), shared by the benchmarks'
`--profile` options: where the time over a floor goes, without hardware counters.

    from kernel_profile import print_kernel_times
    print_kernel_times("ours fwd+bwd", lambda: step())   # warms up twice, profiles the third call
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile


def kernel_times(step, warmup: int = 2) -> dict[str, float]:
    """{kernel name (first 70 chars): milliseconds} for one call of `step`, after `warmup` calls."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for event in prof.events():
        if event.device_type.name == "CUDA":
            key = event.name[:70]
            totals[key] = totals.get(key, 0.0) + event.device_time / 1e3
    return totals


def print_kernel_times(label: str, step, top: int = 10) -> None:
    totals = kernel_times(step)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    step()
    end.record()
    end.synchronize()
    print(f"\nprofile {label}: wall {start.elapsed_time(end):.2f} ms, kernels {sum(totals.values()):.2f} ms")
    for name, ms in sorted(totals.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {ms:8.2f} ms  {name}")
