"""A calculator with a long-tailed latency, for bench_agentic_rollout.py: the built-in calculator's schema and answer,
after a sleep drawn for each call from a Pareto distribution (alpha 1.2, scale `scale_s`, capped at `cap_s`) seeded
by the call's expression, so a call costs the same in every run and rollout mode. Real tools (code execution,
search, sandboxes) answer most calls fast and a few slowly; that tail is what a turn-synchronous loop waits for.

    rollout.multi_turn.tools='[{path: benchmarks/latency_tool.py, name: LatencyCalculator, kwargs: {scale_s: 0.02}}]'
"""

from __future__ import annotations

import random
import time
import zlib

from rltrain.tools.builtin.calculator import calculator

ALPHA = 1.2


class LatencyCalculator:
    schema = calculator.schema

    def __init__(self, scale_s: float = 0.02, cap_s: float = 3.0):
        self.scale_s, self.cap_s = scale_s, cap_s

    def delay(self, expression: str) -> float:
        """This expression's latency in seconds: scale_s · Pareto(ALPHA), at most cap_s (median 1.8 · scale_s; one
        call in 20 past 12 · scale_s, one in 100 past 46 · scale_s)."""
        draw = random.Random(zlib.crc32(str(expression).encode())).paretovariate(ALPHA)
        return min(self.scale_s * draw, self.cap_s)

    def __call__(self, expression: str) -> str:
        time.sleep(self.delay(expression))
        return calculator(expression)
