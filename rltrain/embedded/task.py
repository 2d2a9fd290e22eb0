"""The embedded task: seeded two-operand arithmetic ("37+45=" -> "82"), split into disjoint train and validation sets.

Rows use the same verl format as data files (`rltrain.data.rows.PromptRow`, data_source "rltrain/arithmetic"), so
everything downstream is the path real data takes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from rltrain.config import require
from rltrain.data.rows import PromptRow

DATA_SOURCE = "rltrain/arithmetic"


@dataclass
class TaskConfig:
    max_operand: int = 49       # operands drawn from [0, max_operand]
    operators: str = "+"        # any of "+-*"
    num_val: int = 200          # held-out problems (never trained on)
    seed: int = 0

    def validate(self):
        require(self.max_operand >= 1, "max_operand", "must be >= 1", self.max_operand)
        require(bool(self.operators) and set(self.operators) <= set("+-*"), "operators",
                "must be a non-empty subset of '+-*'", self.operators)
        require(self.num_val >= 1, "num_val", "must be >= 1", self.num_val)
        problems = len(self.operators) * (self.max_operand + 1) ** 2
        require(self.num_val < problems, "num_val", f"leaves no training problems (the task has {problems})",
                self.num_val)


def _answer(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def make_rows(config: TaskConfig) -> tuple[list[PromptRow], list[PromptRow]]:
    """All problems of the task, shuffled with the seed: (train, val), disjoint."""
    problems = [(a, op, b) for op in config.operators
                for a in range(config.max_operand + 1) for b in range(config.max_operand + 1)]
    if config.num_val >= len(problems):
        raise ValueError(f"data.task.num_val={config.num_val} leaves no training problems "
                         f"(the task has {len(problems)})")
    random.Random(config.seed).shuffle(problems)
    rows = [PromptRow(f"{a}{op}{b}=", DATA_SOURCE, str(_answer(a, op, b)), {"index": i})
            for i, (a, op, b) in enumerate(problems)]
    return rows[config.num_val:], rows[:config.num_val]
