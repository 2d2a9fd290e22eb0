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
    # narrow (BV=32) forward: 4w/1s gave wrong outputs (1.3 relative error) and 8 warps an illegal memory access
    # (H100, Triton 3.6, --value-block narrow sweep). Since the state passes read k, w, q as stored (2026-11-23,
    # fourth H100 session, B2 T8192 fwd / fwd+bwd, each setting in its own process): fwd 4w/3s 0.769 / 2.568 ms,
    # 4w/2s 0.790 / 2.605, 4w/1s 0.843, 2w/2s 1.326
    "state_pass_fwd": dict(num_warps=4, num_stages=3),
    # narrow backward, since the state passes read q, k, w as stored: 8w/1s (the setting before) now faults (illegal
    # memory access) and 4w/1s gives gradients off by 1.9e2 (Triton 3.6 on Hopper again miscompiling one stage);
    # 4w/2s 2.605 ms and 8w/2s 2.656 pass. Before that change: at 4 warps / 1 stage Triton 3.6 miscompiled it with
    # bf16 dots and no gate (the IPLR backward; compute-sanitizer: a 1024-byte shared-memory read out of bounds)
    "state_pass_bwd": dict(num_warps=4, num_stages=2),
    # the state passes with 64 value columns per program instead of 32 (common/state_pass.py takes them when
    # sequences × heads × V/64 programs still fill every SM): half the re-reads of k and w. Both 4w/2s since
    # 2026-11-23 (H100, bench_gated_delta_rule.py --value-block wide --sweep-launch, B8 T2048 fwd+bwd): bwd 8w/1s
    # 2.423 → 2.339 ms (8 warps at 234 registers held one block per SM, two waves for 256 programs; 4w/1s 2.309 but
    # 1 stage is the miscompiling pattern above), fwd 4w/1s → 4w/2s 2.433 → 2.375; 8 warps 0.1–0.2 ms slower.
    # Re-swept after the state passes read k, w, q as stored (--value-block wide, fwd / fwd+bwd ms): fwd 4w/2s
    # 0.610 / 2.219 (1s 2.270, 3s 2.334), bwd 4w/1s 2.204, 2s 2.206, 3s 2.219: both stay 4w/2s
    "state_pass_fwd_wide": dict(num_warps=4, num_stages=2),
    "state_pass_bwd_wide": dict(num_warps=4, num_stages=2),
    "local_dv": dict(num_warps=2, num_stages=3),      # common/state_pass.py: Pᵀ dO, chunk-parallel
    "wy_bwd": dict(num_warps=4, num_stages=2),        # common/wy_bwd.py
    "output_fwd": dict(num_warps=8, num_stages=3),    # gated_delta_rule/chunk_fwd.py (with its OUTPUT_BLOCKS)
    "dqkwg": dict(num_warps=8, num_stages=2),         # gated_delta_rule/chunk_bwd.py; 3 stages overflowed shared memory
    # iplr_delta_rule/chunk_fwd.py: 1 stage, which took its shared memory from 121 to 53 KiB with fp32 tiles, reads
    # shared memory out of bounds on Hopper with bf16 dots (Triton 3.6, at 4 and 8 warps, compute-sanitizer; H100,
    # 2026-11-23), as state_pass_bwd did at 4 warps. Since the pass forms X from T and strict(A Kᵀ) and loads its raw
    # tiles as stored (2026-11-24, H100, bf16 B2 T8192 H16 K=V=128, bench_iplr_delta_rule.py --compare-variants):
    # 4w/3s 0.45 ms for its two calls, 4w/2s 0.60. With A Kᵀ formed inside the pass from fp32 register tiles, 4 warps
    # at 1–3 stages gave wrong states and 8 warps faulted; 2 warps ran right (a stage-by-stage check against torch,
    # RESULTS.md).
    "iplr_state_pass_fwd": dict(num_warps=4, num_stages=3),
    # 64 value columns per program (common/state_pass.py's occupancy rule): 250 registers, 73 KiB, two blocks per SM;
    # 0.37 → 0.25 ms against the narrow launch at B8 T2048 (H100, 2026-11-23). Not swept: the narrow one's setting
    "iplr_state_pass_fwd_wide": dict(num_warps=4, num_stages=2),
    # the IPLR solve (T only): the setting of the WY kernel it replaced (4w/3s, swept at 4 and 8 warps × 1–3 stages on
    # H100, 2026-11-23, when that kernel also formed w and u)
    "iplr_solve": dict(num_warps=4, num_stages=3),
    "iplr_output_fwd": dict(num_warps=4, num_stages=2),  # with chunk_fwd.py's OUTPUT_BLOCKS (bench_output_blocks.py)
    # iplr_delta_rule/chunk_bwd.py's query-side (dq, da) and key-side (dk, db, dv) kernels, at 64 value columns (its
    # BWD_BV). H100, bf16 B8 T2048 H16 K=V=128, 2026-11-24, kernel ms: query 8w/2s 0.376, 4w/2s 0.355, 8w/3s 0.362,
    # 4w/3s 0.457, 128 columns 0.474; key 8w/2s 0.470, 8w/3s 0.440, 8w/1s 0.552, 32 columns 0.570
    "iplr_bwd_query": dict(num_warps=4, num_stages=2),
    "iplr_bwd_key": dict(num_warps=8, num_stages=3),
}


# Stage caps for large tiles (K > 128, or fp32 inputs), where the [64, K] tiles double: LAUNCH's stages would overflow
# the 227 KiB of shared memory a Hopper SM has (compile_report.py: the IPLR forward state pass at 3 stages takes 241 KiB
# with fp16 inputs at K = 256, 289 KiB with fp32 ones at K = 128; at 2 stages 173 and 177).
LARGE_TILE_MAX_STAGES: dict[str, int] = {"iplr_state_pass_fwd": 2}


def launch(name: str, large_tiles: bool = False) -> dict[str, int]:
    """Keyword arguments (num_warps, num_stages) for launching kernel `name`; large_tiles: K > 128 or fp32 inputs
    (LARGE_TILE_MAX_STAGES)."""
    settings = LAUNCH[name]
    if large_tiles and name in LARGE_TILE_MAX_STAGES:
        settings = dict(settings, num_stages=min(settings["num_stages"], LARGE_TILE_MAX_STAGES[name]))
    return settings
