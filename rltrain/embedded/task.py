"""The embedded tasks: seeded two-operand arithmetic, split into disjoint train and validation sets.

- `arithmetic` (the default): "37+45=" -> "82", answered in the model's head (data_source "rltrain/arithmetic").
- `tool_arithmetic`: multi-digit products ("37*45=" -> "1665", operands from [min_operand, max_operand]) that the
  model may hand to the built-in `calculator` tool; the prompt is a chat message, so the tool's schema reaches the
  model through the chat template, and the reward scores the final answer, after the last tool response
  (data_source "rltrain/tool_arithmetic"). It runs as multi-turn episodes: select the preset `task=tool_arithmetic`
  (config/task/tool_arithmetic.yaml), which turns on rollout.multi_turn with the calculator. Warm start and its
  demonstrations: rltrain/embedded/tool_task.py.
- `code_arithmetic`: a formula in math notation ("f(x)=3x^2-7") that the model writes as a Python program
  ("f=lambda x:3*x**2-7"), which the built-in `code` reward runs in the sandbox against assert lines on held-out x
  values (data_source "rltrain/code_arithmetic"; preset `task=code_arithmetic`). Rows, tests and warm start:
  rltrain/embedded/code_task.py.
- `chain_arithmetic`: a sum of several terms ("37+45+18+90=") answered with worked steps, one running total a line,
  then "#### 190", scored by the `math` reward (data_source "rltrain/chain_arithmetic"; preset
  `task=chain_arithmetic`, sized for one GPU). Rows and warm start: rltrain/embedded/chain_task.py.

Rows use the same verl format as data files (`rltrain.data.rows.PromptRow`), so everything downstream is the path
real data takes.
"""

from __future__ import annotations

import random

from rltrain.data.rows import PromptRow
from rltrain.embedded import chain_task, code_task
from rltrain.embedded.config import TaskConfig

DATA_SOURCE = "rltrain/arithmetic"
TOOL_DATA_SOURCE = "rltrain/tool_arithmetic"


def _answer(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def make_rows(config: TaskConfig) -> tuple[list[PromptRow], list[PromptRow]]:
    """All problems of the task, shuffled with the seed: (train, val), disjoint."""
    operands = range(config.min_operand, config.max_operand + 1)
    if config.uses_chain:
        problems = chain_task.problems(config)   # drawn with the seed from a space too large to list
    elif config.uses_code:
        problems = code_task.problems(config.min_operand, config.max_operand, config.operators)
    else:
        problems = [(a, op, b) for op in config.operators for a in operands for b in operands]
    if config.num_val >= len(problems):
        raise ValueError(f"data.task.num_val={config.num_val} leaves no training problems "
                         f"(the task has {len(problems)})")
    random.Random(config.seed).shuffle(problems)
    if config.uses_chain:
        rows = chain_task.make_rows(problems)
    elif config.uses_code:
        rows = code_task.make_rows(problems, config.seed)
    elif config.uses_tools:
        rows = [PromptRow([{"role": "user", "content": f"{a}{op}{b}="}], TOOL_DATA_SOURCE, str(_answer(a, op, b)),
                          {"index": i}) for i, (a, op, b) in enumerate(problems)]
    else:
        rows = [PromptRow(f"{a}{op}{b}=", DATA_SOURCE, str(_answer(a, op, b)), {"index": i})
                for i, (a, op, b) in enumerate(problems)]
    return rows[config.num_val:], rows[:config.num_val]
