"""Per-kernel GPU time of one call (torch.profiler, CUDA kernel time summed by kernel name), shared by the benchmarks'
`--profile` options: where the time over a floor goes, without hardware counters.

    from kernel_profile import print_kernel_times
    print_kernel_times("ours fwd+bwd", lambda: step())   # warms up twice, profiles the third call
    print_autotune_picks("fla.")                         # the configs a peer's autotuner picked meanwhile
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile


def kernel_times(step, warmup: int = 2, queued: bool = False, timeline: int = 0
                 ) -> tuple[dict[str, float], list[tuple[float, str, str]]]:
    """({kernel name (first 70 chars): milliseconds}, the idle gaps between consecutive GPU activities as
    (ms, activity before, activity after), largest first) for one call of `step`, after `warmup` calls.
    queued: the call is queued behind timing.py's spin kernel (left out of both), so its host set-up overlaps GPU
    work as inside a training step and the gaps are the GPU's own idle time. timeline: print the first that many
    activities (start offset, duration, name)."""
    from timing import SPIN_CYCLES

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        if queued:
            torch.cuda._sleep(SPIN_CYCLES)
        step()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    spans, slow_host = [], []
    for event in prof.events():
        if event.device_type.name == "CUDA" and "spin_kernel" not in event.name:
            key = event.name[:70]
            totals[key] = totals.get(key, 0.0) + event.device_time / 1e3
            spans.append((event.time_range.start, event.time_range.end, key))
        elif event.cpu_time_total > 300 and not event.cpu_children:   # leaf host calls over 0.3 ms
            slow_host.append((event.cpu_time_total / 1e3, event.name[:70]))
    spans.sort()
    for start, end, name in spans[:timeline]:
        print(f"  {(start - spans[0][0]) / 1e3:9.3f} ms +{(end - start) / 1e3:7.3f}  {name[:60]}")
    gaps = [((b[0] - a[1]) / 1e3, a[2], b[2]) for a, b in zip(spans, spans[1:]) if b[0] > a[1]]
    for ms, name in sorted(slow_host, reverse=True)[:5]:
        print(f"  host call {ms:.3f} ms: {name}")
    return totals, sorted(gaps, reverse=True)


def print_kernel_times(label: str, step, top: int = 10, queued: bool = False, timeline: int = 0) -> None:
    """kernel_times of one call, its wall time (timing.py, queued or from idle as the profile), the `top` kernels
    and the largest idle gaps."""
    from timing import time_ms

    totals, gaps = kernel_times(step, queued=queued, timeline=timeline)
    wall = time_ms(step, queued)
    mode = " (queued)" if queued else ""
    print(f"\nprofile {label}{mode}: wall {wall:.2f} ms, kernels {sum(totals.values()):.2f} ms")
    for name, ms in sorted(totals.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {ms:8.2f} ms  {name}")
    print(f"  idle between GPU activities: {sum(g[0] for g in gaps):.2f} ms in {len(gaps)} gaps; largest:")
    for ms, before, after in gaps[:6]:
        print(f"  {ms:8.3f} ms  after {before[:40]} | before {after[:40]}")


def print_fwd_bwd_kernel_times(label: str, impls, leaves: list, call, do, top: int = 14) -> None:
    """print_kernel_times of one forward+backward for each (name, fn) of `impls` (an fn of None skipped): call(fn)
    runs the forward, its first output takes `do` backward, the `leaves`' gradients cleared before each step. The
    delta-rule benches' `--profile`, ours and a peer's on the same inputs."""
    for name, fn in impls:
        if fn is None:
            continue

        def step(fn=fn):
            for t in leaves:
                t.grad = None
            call(fn)[0].backward(do)

        print_kernel_times(f"{name} {label}", step, top=top)


def print_autotune_picks(prefix: str) -> None:
    """The config each autotuned kernel of the modules under `prefix` picked in this process, per tuning key."""
    import sys

    from triton.runtime.autotuner import Autotuner

    seen = set()
    print(f"\nautotune picks ({prefix}*):")
    for module in [m for name, m in sys.modules.items() if name.startswith(prefix) and m is not None]:
        for attr, tuner in vars(module).items():
            for _ in range(3):  # under triton.heuristics the Autotuner is the wrapper's .fn
                if isinstance(tuner, Autotuner) or not hasattr(tuner, "fn"):
                    break
                tuner = tuner.fn
            if isinstance(tuner, Autotuner) and id(tuner) not in seen and tuner.cache:
                seen.add(id(tuner))
                for key, config in tuner.cache.items():
                    print(f"  {attr}: {config} (key {key})")
