"""Launch settings (warps, software-pipeline stages) of the delta-rule chunk kernels, in one table.

One home so that a tuning run can sweep them (`kernels/benchmarks/bench_gated_delta_rule.py --sweep-launch` times
every setting, checks each against the fp32 reference, and prints the table to paste here). No autotuner: on Hopper
with Triton 3.4–3.7 some warp counts miscompile delta-rule backward kernels (fla #984: wrong dk at 4 warps), so a
setting is only taken once a GPU run has checked its gradients, never picked by timing alone.
"""

from __future__ import annotations

import triton

# Every setting below passed the gradient check on a GPU. Times: H100, Triton 3.6, bf16 H16 K=V=128, B8 T2048 unless
# marked (B2 T8192: the narrow launch of the state passes), from `--sweep-launch` / `--profile`. A setting at 1 stage
# is avoided where Triton 3.6 miscompiles it (wrong outputs or out-of-bounds shared-memory reads on Hopper).
LAUNCH: dict[str, dict[str, int]] = {
    "wy_fwd": dict(num_warps=4, num_stages=3),        # common/wy.py: A, the solve; 2 warps +0.94 ms, 8 warps +0.34
    # B2 T8192 fwd / fwd+bwd: 4w/3s 0.769 / 2.568 ms, 4w/2s 0.790 / 2.605, 4w/1s 0.843, 2w/2s 1.326
    "state_pass_fwd": dict(num_warps=4, num_stages=3),
    # 4w/2s 2.605 ms fwd+bwd at B2 T8192, 8w/2s 2.656; 4w/1s gives wrong gradients and 8w/1s faults
    "state_pass_bwd": dict(num_warps=4, num_stages=2),
    # 64 value columns per program (state_pass.state_launch's occupancy rule). fwd 4w/2s 0.610 / 2.219 ms fwd+bwd
    # (1s 2.270, 3s 2.334); bwd 4w/2s 2.206 (1s 2.204, 3s 2.219); 8 warps 0.1–0.2 ms slower
    "state_pass_fwd_wide": dict(num_warps=4, num_stages=2),
    "state_pass_bwd_wide": dict(num_warps=4, num_stages=2),
    "local_dv": dict(num_warps=2, num_stages=3),      # common/state_pass.py: Pᵀ dO, chunk-parallel; −0.05 ms vs 4w/2s
    "wy_bwd": dict(num_warps=4, num_stages=2),        # common/wy_bwd.py; −0.23 ms vs 8w/3s
    "output_fwd": dict(num_warps=8, num_stages=3),    # gated_delta_rule/chunk_fwd.py (with its OUTPUT_BLOCKS)
    "dqkwg": dict(num_warps=8, num_stages=2),         # gated_delta_rule/chunk_bwd.py; 3 stages overflow shared memory,
                                                      # 2 warps 3× slower
    # iplr_delta_rule/chunk_fwd.py, B2 T8192: 4w/3s 0.45 ms for its two calls, 4w/2s 0.60; 1 stage reads shared
    # memory out of bounds with bf16 dots
    "iplr_state_pass_fwd": dict(num_warps=4, num_stages=3),
    # 64 value columns: 250 registers, 73 KiB, two blocks per SM; 0.25 ms against the narrow launch's 0.37. Not swept
    "iplr_state_pass_fwd_wide": dict(num_warps=4, num_stages=2),
    "iplr_solve": dict(num_warps=4, num_stages=3),    # the IPLR solve (T only), at wy_fwd's setting
    "iplr_output_fwd": dict(num_warps=4, num_stages=2),  # with chunk_fwd.py's OUTPUT_BLOCKS (bench_output_blocks.py)
    # iplr_delta_rule/chunk_bwd.py's query-side (dq, da) and key-side (dk, db, dv) kernels at 64 value columns, kernel
    # ms: query 4w/2s 0.355, 8w/2s 0.376, 8w/3s 0.362, 128 columns 0.474; key 8w/3s 0.440, 8w/2s 0.470, 8w/1s 0.552,
    # 32 columns 0.570
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


# The narrowest K / V tile a delta-rule chunk kernel takes. At 16-wide tiles (K or V = 16) Triton 3.6 on Hopper compiled
# dots of these kernels to out-of-range shared-memory accesses (compute-sanitizer: the gated WY backward and the IPLR
# forward state pass) and to wrong IPLR gradients in fp16; every kernel masks its K and V padding, so wider is exact.
MIN_TILE = 32


def tile(size: int, cap: int | None = None) -> int:
    """The K or V tile for a dimension of `size`: its power of two, at least MIN_TILE, at most `cap` (if given)."""
    width = max(MIN_TILE, triton.next_power_of_2(size))
    return width if cap is None else min(cap, width)
