"""How the delta-rule chunk kernels launch, as one argument: `Tuning()` holds the shipped choices, and a sweep passes
another value for a field.

The chunked ops (chunk_gated_delta_rule, chunk_iplr_delta_rule, chunk_gated_delta_product) take `tuning=` and hand it
down to every launch, forward and backward; no module setting is read at call time, so a benchmark tries a setting by
passing it (kernels/benchmarks/delta_rule_bench_common.py builds one from --launch, --value-block, --output-blocks
and --dot-per-kernel) and the next call in the same process runs the shipped kernels again.

    from rltrain_kernels.ops.common.tuning import Tuning
    o, _ = chunk_gated_delta_rule(q, k, v, g, beta, tuning=Tuning(launches={"wy_bwd": (8, 2)}, value_block="narrow"))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType

from rltrain_kernels.utils import triton_interpreted

from .launch import LARGE_TILE_MAX_STAGES, LAUNCH

VALUE_BLOCKS = ("auto", "wide", "narrow")
DOT_OVERRIDES = ("ieee", "tf32", "bf16")
LAUNCH_KINDS = ("wide", "narrow")  # the state passes' two launches (state_pass.state_launch)


@dataclasses.dataclass(frozen=True)
class Tuning:
    """The delta-rule kernels' launch choices; every field's default is what ships. Validated on construction."""

    # (warps, stages) per launch.py LAUNCH entry, in place of the table's
    launches: Mapping[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    # The state passes' value columns per program: "auto" (state_pass.state_launch's occupancy rule), or "wide" (64)
    # / "narrow" (NARROW_BV's) whatever the batch
    value_block: str = "auto"
    # The output passes' (BK, BV) tiles (gated delta rule, IPLR); None: each op's OUTPUT_BLOCKS
    output_blocks: tuple[int, int] | None = None
    # IPLR's forward state pass, per launch: its raw input tiles (a, k, b, v) through registers as fp32 (True), or
    # loaded as stored, which Triton prefetches into shared memory (False). Registers let the wide launch hold two
    # blocks per SM (H100, bf16 B8 T2048 H16 K=V=128: 0.23 ms per call, 0.28 stored); prefetching pays once a chain
    # runs alone (B2 T8192: 0.22 ms, 0.42 in registers). Batches of uneven lengths load as stored in either launch
    # (iplr_delta_rule/chunk_fwd.py BALANCED); K > 128 and fp32 inputs always take registers (stored tiles overflow
    # shared memory).
    iplr_raw_in_registers: Mapping[str, bool] = dataclasses.field(
        default_factory=lambda: {"wide": True, "narrow": False})
    # IPLR's reverse state pass, per launch: its a tile through registers as fp32 (True) or as stored (False, one
    # shared-memory buffer per pipeline stage). Always registers for K > 128 (bf16 K = 256 stored tiles take the pass
    # to 233 KiB of shared memory, over Hopper's 227).
    iplr_a_in_registers: Mapping[str, bool] = dataclasses.field(
        default_factory=lambda: {"wide": True, "narrow": False})
    # DOT_PREC (ieee | tf32 | bf16) of single Triton kernels, by name, in place of the op's: finds the kernel a
    # precision breaks (the stored intermediates keep their dtype)
    dots: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # SMs the state passes' occupancy rule plans for; None: the device's (1 under the interpreter)
    sm_count: int | None = None

    def __post_init__(self):
        for name, setting in self.launches.items():
            if name not in LAUNCH or len(setting) != 2 or not all(isinstance(x, int) and x > 0 for x in setting):
                raise ValueError(f"Tuning.launches: {name!r}: {setting!r} must be (warps, stages) for an entry of "
                                 f"ops/common/launch.py ({', '.join(LAUNCH)})")
        if self.value_block not in VALUE_BLOCKS:
            raise ValueError(f"Tuning.value_block must be one of {', '.join(VALUE_BLOCKS)}; got {self.value_block!r}")
        if self.output_blocks is not None and (
                len(self.output_blocks) != 2 or any(b not in (16, 32, 64, 128, 256) for b in self.output_blocks)):
            raise ValueError(f"Tuning.output_blocks must be (BK, BV), each a power of two from 16 to 256; got "
                             f"{self.output_blocks!r}")
        for field in ("iplr_raw_in_registers", "iplr_a_in_registers"):
            value = getattr(self, field)
            if set(value) != set(LAUNCH_KINDS) or not all(isinstance(x, bool) for x in value.values()):
                raise ValueError(f"Tuning.{field} must map 'wide' and 'narrow' to a bool; got {dict(value)!r}")
        for kernel, prec in self.dots.items():
            if prec not in DOT_OVERRIDES:
                raise ValueError(f"Tuning.dots: {kernel!r}: {prec!r} must be one of {', '.join(DOT_OVERRIDES)}")
        if self.sm_count is not None and not (isinstance(self.sm_count, int) and self.sm_count > 0):
            raise ValueError(f"Tuning.sm_count must be a positive int or None; got {self.sm_count!r}")
        object.__setattr__(self, "launches", MappingProxyType({n: tuple(s) for n, s in self.launches.items()}))
        for field in ("iplr_raw_in_registers", "iplr_a_in_registers", "dots"):  # read-only copies
            object.__setattr__(self, field, MappingProxyType(dict(getattr(self, field))))
        if self.output_blocks is not None:
            object.__setattr__(self, "output_blocks", tuple(self.output_blocks))

    def launch(self, name: str, large_tiles: bool = False) -> dict[str, int]:
        """Keyword arguments (num_warps, num_stages) for launching LAUNCH entry `name`; large_tiles: K > 128 or fp32
        inputs, whose stages LARGE_TILE_MAX_STAGES caps."""
        if name in self.launches:
            warps, stages = self.launches[name]
            settings = dict(num_warps=warps, num_stages=stages)
        else:
            settings = dict(LAUNCH[name])
        if large_tiles and name in LARGE_TILE_MAX_STAGES:
            settings["num_stages"] = min(settings["num_stages"], LARGE_TILE_MAX_STAGES[name])
        return settings

    def dot(self, kernel, dot_prec: str) -> str:
        """DOT_PREC for a launch of Triton kernel `kernel`: `dots`' entry for its name (interpreted modes under the
        interpreter, as precision.dot_precision gives them), else the op's `dot_prec`."""
        prec = self.dots.get(kernel.__name__) if self.dots else None
        if prec is None:
            return dot_prec
        return prec + ("_interpreted" if prec != "ieee" and triton_interpreted() else "")


DEFAULT_TUNING = Tuning()


def check_tuning(tuning: Tuning) -> Tuning:
    """`tuning` itself when it is a Tuning, else a TypeError naming the argument."""
    if not isinstance(tuning, Tuning):
        raise TypeError(f"tuning must be a rltrain_kernels.ops.common.tuning.Tuning; got {type(tuning).__name__}")
    return tuning
