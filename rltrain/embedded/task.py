"""The embedded tasks: seeded two-operand arithmetic, split into disjoint train and validation sets.

- `arithmetic` (the default): "37+45=" -> "82", answered in the model's head (data_source "rltrain/arithmetic").
- `tool_arithmetic`: multi-digit products ("37*45=" -> "1665", operands from [min_operand, max_operand]) that the
  model may hand to the built-in `calculator` tool; the prompt is a chat message, so the tool's schema reaches the
  model through the chat template, and the reward scores the final answer, after the last tool response
  (data_source "rltrain/tool_arithmetic"). It runs as multi-turn episodes: select the preset `task=tool_arithmetic`
  (config/task/tool_arithmetic.yaml), which turns on rollout.multi_turn with the calculator. Warm start and its
  demonstrations: rltrain/embedded/tool_task.py.

Rows use the same verl format as data files (`rltrain.data.rows.PromptRow`), so everything downstream is the path
real data takes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from rltrain.config import require
from rltrain.data.rows import PromptRow

DATA_SOURCE = "rltrain/arithmetic"
TOOL_DATA_SOURCE = "rltrain/tool_arithmetic"
KINDS = ("arithmetic", "tool_arithmetic")


@dataclass
class TaskConfig:
    kind: str = "arithmetic"    # arithmetic | tool_arithmetic (module docstring)
    min_operand: int = 0        # operands drawn from [min_operand, max_operand]
    max_operand: int = 49
    operators: str = "+"        # any of "+-*"
    num_val: int = 200          # held-out problems (never trained on)
    seed: int = 0

    def validate(self):
        require(self.kind in KINDS, "kind", f"must be one of {', '.join(KINDS)}", self.kind)
        require(self.min_operand >= 0, "min_operand", "must be >= 0", self.min_operand)
        require(self.max_operand >= max(1, self.min_operand), "max_operand", f"must be >= 1 and >= min_operand "
                f"({self.min_operand})", self.max_operand)
        require(bool(self.operators) and set(self.operators) <= set("+-*"), "operators",
                "must be a non-empty subset of '+-*'", self.operators)
        require(self.num_val >= 1, "num_val", "must be >= 1", self.num_val)
        problems = len(self.operators) * (self.max_operand - self.min_operand + 1) ** 2
        require(self.num_val < problems, "num_val", f"leaves no training problems (the task has {problems})",
                self.num_val)

    @property
    def uses_tools(self) -> bool:
        return self.kind == "tool_arithmetic"


def _answer(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def make_rows(config: TaskConfig) -> tuple[list[PromptRow], list[PromptRow]]:
    """All problems of the task, shuffled with the seed: (train, val), disjoint."""
    operands = range(config.min_operand, config.max_operand + 1)
    problems = [(a, op, b) for op in config.operators for a in operands for b in operands]
    if config.num_val >= len(problems):
        raise ValueError(f"data.task.num_val={config.num_val} leaves no training problems "
                         f"(the task has {len(problems)})")
    random.Random(config.seed).shuffle(problems)
    if config.uses_tools:
        rows = [PromptRow([{"role": "user", "content": f"{a}{op}{b}="}], TOOL_DATA_SOURCE, str(_answer(a, op, b)),
                          {"index": i}) for i, (a, op, b) in enumerate(problems)]
    else:
        rows = [PromptRow(f"{a}{op}{b}=", DATA_SOURCE, str(_answer(a, op, b)), {"index": i})
                for i, (a, op, b) in enumerate(problems)]
    return rows[config.num_val:], rows[:config.num_val]
