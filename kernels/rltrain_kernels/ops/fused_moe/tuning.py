"""The fused MoE kernels' tiles and launch settings as one argument: `MoeTuning()` holds the shipped ones, and a sweep
passes others to `fused_moe(..., tuning=...)` (kernels/benchmarks/bench_fused_moe.py --sweep). Under the Triton
interpreter the kernels take small fixed tiles instead (grouped_gemm.py, weight_grad.py).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class MoeTuning:
    """Every default is what ships; validated on construction."""

    # Rows per tile of the four row-tiled GEMMs (one Routing serves them all). 128: the tile the wgmma instructions
    # fill with 8 warps; at Qwen3-30B-A3B's 512 rows per expert (8192 tokens, top-8 of 128) the last tile of an expert
    # is half empty on average, 11% of the rows computed.
    row_tile: int = 128
    # (BLOCK_N, BLOCK_K, num_warps, num_stages) per row-tiled kernel, bf16/fp16 on H100; fp32 inputs cap the stages at
    # 2 (their tiles take twice the shared memory). The two-accumulator kernels take 64 columns of each half (128 × 128
    # fp32 of accumulators in all, the registers of one 128 × 128 tile).
    up_swiglu: tuple[int, int, int, int] = (64, 64, 8, 4)
    scatter: tuple[int, int, int, int] = (128, 64, 8, 4)
    down_backward: tuple[int, int, int, int] = (64, 64, 8, 4)
    # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of the weight gradients, bf16/fp16 on H100: a 128 × 128 output
    # tile, 64 rows a step (sm_90 compile: 116-130 registers, no spills, 66-82 KiB of shared memory). fp32 inputs take
    # weight_grad.py's LAUNCH_FP32.
    weight_grad: tuple[int, int, int, int, int] = (128, 128, 64, 8, 3)

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            values = (value,) if field.name == "row_tile" else tuple(value)
            size = {"row_tile": 1, "weight_grad": 5}.get(field.name, 4)
            if len(values) != size or not all(isinstance(x, int) and x > 0 for x in values):
                raise ValueError(f"MoeTuning.{field.name} must be {size} positive int(s); got {value!r}")
            if field.name != "row_tile":
                object.__setattr__(self, field.name, values)


DEFAULT_MOE_TUNING = MoeTuning()
