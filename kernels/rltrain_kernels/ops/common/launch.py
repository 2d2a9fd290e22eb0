"""Launch settings (warps, software-pipeline stages) of the delta-rule chunk kernels, in one table.

The shipped setting of each launch; a sweep passes others through the ops' `tuning` argument (common/tuning.py:
`kernels/benchmarks/bench_gated_delta_rule.py --sweep-launch` times every setting, each checked against the fp32
reference first). No autotuner: on Hopper with Triton 3.4–3.7 some warp counts miscompile delta-rule backward kernels
(fla #984: wrong dk at 4 warps), so a setting is only taken once a GPU run has checked its gradients, never picked by
timing alone.
"""

from __future__ import annotations

import triton

# Every setting passed the gradient check on a GPU; beside it, what it beat (H100, Triton 3.6, bf16 H16 K=V=128, B8
# T2048 unless marked; `--sweep-launch` / `--profile`). 1 stage is avoided where Triton 3.6 miscompiles it on Hopper
# (wrong outputs or out-of-bounds shared-memory reads in the state passes).
LAUNCH: dict[str, dict[str, int]] = {
    "wy_fwd": dict(num_warps=4, num_stages=3),        # common/wy.py, the solve: 8 warps +0.34 ms
    "state_pass_fwd": dict(num_warps=4, num_stages=3),  # B2 T8192 fwd+bwd 2.568 ms, 2.605 at 2 stages
    "state_pass_bwd": dict(num_warps=4, num_stages=2),  # B2 T8192 fwd+bwd 2.605 ms, 8 warps 2.656
    # 64 value columns per program (state_pass.state_launch's occupancy rule): fwd+bwd 2.219 ms, 2.270 at 1 stage
    "state_pass_fwd_wide": dict(num_warps=4, num_stages=2),
    "state_pass_bwd_wide": dict(num_warps=4, num_stages=2),  # 2.206 ms, 2.219 at 3 stages
    "local_dv": dict(num_warps=2, num_stages=3),      # common/state_pass.py, Pᵀ dO: −0.05 ms vs 4w/2s
    "wy_bwd": dict(num_warps=4, num_stages=2),        # common/wy_bwd.py: −0.23 ms vs 8w/3s
    "output_fwd": dict(num_warps=8, num_stages=3),    # gated_delta_rule/chunk_fwd.py: 0.156 ms, 4w/3s 0.158
    "dqkwg": dict(num_warps=8, num_stages=2),         # common/chunk_bwd.py: 3 stages overflow shared memory
    "iplr_state_pass_fwd": dict(num_warps=4, num_stages=3),  # B2 T8192: 0.45 ms for its two calls, 0.60 at 2 stages
    "iplr_state_pass_fwd_wide": dict(num_warps=4, num_stages=2),  # 0.25 ms, the narrow launch 0.37; not swept
    "iplr_solve": dict(num_warps=4, num_stages=3),    # the IPLR solve (T only), at wy_fwd's setting
    "iplr_output_fwd": dict(num_warps=4, num_stages=2),  # iplr_delta_rule/chunk_fwd.py: 0.205 ms (1 stage 0.202)
    "iplr_bwd_query": dict(num_warps=4, num_stages=2),   # iplr_delta_rule/chunk_bwd.py dq, da: 0.355 ms, 8w/3s 0.362
    "iplr_bwd_key": dict(num_warps=8, num_stages=3),     # dk, db, dv: 0.440 ms, 8w/2s 0.470
    # KDA (ops/kda): the intra-chunk kernels swept on an H200 (bench_kda.py --sweep-launch: gradients checked, B8 T2048
    # fwd+bwd); the others first settings, not yet swept
    "kda_intra_fwd": dict(num_warps=2, num_stages=3),    # kda/intra.py, a 16-row block a program: 4w/2s +0.13 ms
    "kda_solve": dict(num_warps=4, num_stages=2),        # kda/intra.py: T from Akk; 2 warps +0.34 ms
    "kda_gated_keys": dict(num_warps=4, num_stages=2),   # kda/chunk_fwd.py: the state passes' K̃, K̂, scale Q ⊙ Γ
    "kda_state_fwd": dict(num_warps=4, num_stages=2),    # kda/chunk_fwd.py
    "kda_output_fwd": dict(num_warps=4, num_stages=2),   # kda/chunk_fwd.py
    "kda_state_bwd": dict(num_warps=4, num_stages=2),    # kda/chunk_bwd.py
    "kda_dv": dict(num_warps=8, num_stages=2),           # kda/chunk_bwd.py: dv, dβ, dM_P, dA (4 warps spill 184 B)
    "kda_dqk": dict(num_warps=8, num_stages=2),          # kda/chunk_bwd.py: state-side dq, dk, dG (4 warps: 336 B)
    "kda_intra_bwd": dict(num_warps=2, num_stages=2),    # kda/intra.py, a 16-row block a program: 4w/2s +0.23 ms
}


# Stage caps for large tiles (K > 128, or fp32 inputs), where the [64, K] tiles double: LAUNCH's stages would overflow
# the 227 KiB of shared memory a Hopper SM has (compile_report.py: the IPLR forward state pass at 3 stages takes 241 KiB
# with fp16 inputs at K = 256; 173 at 2 stages).
LARGE_TILE_MAX_STAGES: dict[str, int] = {"iplr_state_pass_fwd": 2}


# The narrowest K / V tile a delta-rule chunk kernel takes. At 16-wide tiles (K or V = 16) Triton 3.6 on Hopper compiled
# dots of these kernels to out-of-range shared-memory reads (compute-sanitizer: the gated WY backward and the IPLR
# output pass) and to wrong IPLR gradients in fp16; every kernel masks its K and V padding, so wider is exact.
MIN_TILE = 32


def tile(size: int, cap: int | None = None) -> int:
    """The K or V tile for a dimension of `size`: its power of two, at least MIN_TILE, at most `cap` (if given)."""
    width = max(MIN_TILE, triton.next_power_of_2(size))
    return width if cap is None else min(cap, width)
