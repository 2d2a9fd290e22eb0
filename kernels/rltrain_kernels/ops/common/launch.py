"""Launch settings (warps, software-pipeline stages) of the delta-rule chunk kernels, in one table.

One home so that a tuning run can sweep them (`kernels/benchmarks/bench_gated_delta_rule.py --sweep-launch` times
every setting, checks each against the fp32 reference, and prints the table to paste here). No autotuner: on Hopper
with Triton 3.4–3.7 some warp counts miscompile delta-rule backward kernels (fla #984: wrong dk at 4 warps), so a
setting is only taken once a GPU run has checked its gradients, never picked by timing alone.
"""

from __future__ import annotations

# Sweep on H200, triton 3.6, 2026-11-22 (bf16 B8 T2048 H16 K=V=128, fwd+bwd 8.8 ms with 4 warps / 3 stages
# everywhere; every setting below passed the gradient check): state_pass_bwd 4w/1s −0.66 ms (2 warps: 2–4× slower),
# output_fwd 2w/2s −0.47, state_pass_fwd 4w/2s −0.51, wy_bwd 4w/2s −0.23 vs 8w/3s; dqkwg best as it was (8w/2s;
# 2 warps 3× slower). Second sweep, after the solve and backward rework (fwd+bwd 4.35 ms): wy_fwd best as it is
# (4w/3s; 2 warps +0.94 ms, 8 warps +0.34), local_dv 2w/3s −0.05 ms vs 4w/2s; every setting's gradients 2.5e-3.
# Third, the state passes with BV=64 (the *_wide entries; from 4.30 ms): fwd 4w/1s −0.08, bwd 8w/1s −0.22 (2 warps
# 3–8× slower; 3 stages of the backward overflow shared memory). At B2 T8192 (32 sequence-heads: 64 programs on
# 132 SMs) BV=64 was slower, 4.65 → 5.29 ms, hence the occupancy rule.
LAUNCH: dict[str, dict[str, int]] = {
    "wy_fwd": dict(num_warps=4, num_stages=3),        # common/wy.py: A, the solve, w and u
    "state_pass_fwd": dict(num_warps=4, num_stages=2),
    "state_pass_bwd": dict(num_warps=4, num_stages=1),
    # the state passes with 64 value columns per program instead of 32 (common/state_pass.py takes them when
    # sequences × heads × V/64 programs still fill every SM): half the re-reads of k and w
    "state_pass_fwd_wide": dict(num_warps=4, num_stages=1),
    "state_pass_bwd_wide": dict(num_warps=8, num_stages=1),
    "local_dv": dict(num_warps=2, num_stages=3),      # common/state_pass.py: Pᵀ dO, chunk-parallel
    "wy_bwd": dict(num_warps=4, num_stages=2),        # common/wy_bwd.py
    "output_fwd": dict(num_warps=2, num_stages=2),    # gated_delta_rule/chunk_fwd.py
    "dqkwg": dict(num_warps=8, num_stages=2),         # gated_delta_rule/chunk_bwd.py; 3 stages overflowed shared memory
    # iplr_delta_rule/chunk_fwd.py (untimed): 2 stages of its w, b, k, u, v tiles take 121 KiB of shared memory at
    # bf16 B8 T2048 H16 K=V=128 (compile_report.py, sm_90), so one block per SM runs the 512 sequence-long programs
    # in 4 waves over 132 SMs; 1 stage takes 53 KiB without spilling, 2 blocks per SM, 2 waves
    "iplr_state_pass_fwd": dict(num_warps=4, num_stages=1),
    # the other IPLR kernels, untimed (Triton's defaults and 8 warps where eight [64, 64] fp32 tiles live at once);
    # bench_iplr_delta_rule.py --sweep-launch times them. With bf16 dots the IPLR backward failed on H100 (wrong
    # gradients, then an illegal memory access): fla #984 saw that from a 4-warp WY backward on Hopper (2 warps
    # right), so these are the first suspects (`--dot bf16 --sweep-launch iplr_wy_bwd iplr_output_bwd`)
    "iplr_wy_fwd": dict(num_warps=4, num_stages=3),
    "iplr_output_fwd": dict(num_warps=4, num_stages=3),
    "iplr_output_bwd": dict(num_warps=8, num_stages=3),  # both of iplr_delta_rule/chunk_bwd.py's output kernels
    "iplr_wy_bwd": dict(num_warps=8, num_stages=3),
}


def launch(name: str) -> dict[str, int]:
    """Keyword arguments (num_warps, num_stages) for launching kernel `name`."""
    return LAUNCH[name]
