"""The embedded code task (data.task.kind=code_arithmetic, preset task=code_arithmetic): the model reads a function in
math notation and writes it as a Python program, which the built-in `code` reward runs in the sandbox against
assert lines on x values the prompt never shows.

    prompt   f(x)=3x^2-7\\n                    (math notation: implicit products, ^ for powers)
    answer   f=lambda x:3*x**2-7              (any program defining an equal f passes: `f=lambda x:x*x*3-7` too)
    tests    assert f(-4) == 41 ...           (extra_info["tests"]: TEST_POINTS values of x drawn per row)

Forms (a, b from [min_operand, max_operand], op from data.task.operators, a subset of "+-"): `ax op b`, `ax^2 op b`,
`a(x op b)`. Written as they stand, they are wrong Python in two ways the sandbox tells apart from right programs:
`3x` does not compile, and `x^2` runs but is x XOR 2, so only the tests on held-out points catch it.

The warm start (`sft_batch`) imitates a model that has read more mathematics than Python: each example's answer is
the Python translation with probability PYTHON_SHARE, else the formula copied verbatim after `f=lambda x:`. So it
learns the format and the copying well but writes Python on about PYTHON_SHARE of its samples and never greedily
(held-out accuracy starts near 0); RL, rewarded by the programs' test results, learns to translate. The warm start
stops once `transcription_accuracy` (greedy answers that are a right copy in either notation, compared as text in
process: a stopping rule, not the reward) reaches model.embedded.warmstart_target_accuracy.
"""

from __future__ import annotations

import random

import torch

from rltrain.data.rows import PromptRow
from rltrain.data.sampler import encode_prompts
from rltrain.workers.batch import IGNORE_INDEX, supervised_batch

DATA_SOURCE = "rltrain/code_arithmetic"
FORMS = ("linear", "square", "factored")
PREFIX = "f=lambda x:"
TEST_POINTS = 4            # asserts per row: x drawn from TEST_RANGE, none of them shown in the prompt
TEST_RANGE = range(-9, 13)
PYTHON_SHARE = 0.15        # warm-start answers in Python: then ~3% of sampled programs pass (seed 0, first RL step)


def math_notation(form: str, a: int, op: str, b: int) -> str:
    return {"linear": f"{a}x{op}{b}", "square": f"{a}x^2{op}{b}", "factored": f"{a}(x{op}{b})"}[form]


def python_notation(form: str, a: int, op: str, b: int) -> str:
    return {"linear": f"{a}*x{op}{b}", "square": f"{a}*x**2{op}{b}", "factored": f"{a}*(x{op}{b})"}[form]


def evaluate(form: str, a: int, op: str, b: int, x: int) -> int:
    sign = 1 if op == "+" else -1
    return {"linear": a * x + sign * b, "square": a * x * x + sign * b, "factored": a * (x + sign * b)}[form]


def make_rows(problems: list[tuple], seed: int) -> list[PromptRow]:
    """One row per (form, a, op, b): the prompt, the Python answer as ground truth, the assert lines as tests."""
    rng = random.Random(seed)
    rows = []
    for i, problem in enumerate(problems):
        points = rng.sample(TEST_RANGE, TEST_POINTS)
        tests = [f"assert f({x}) == {evaluate(*problem, x)}" for x in points]
        rows.append(PromptRow(f"f(x)={math_notation(*problem)}\n", DATA_SOURCE, PREFIX + python_notation(*problem),
                              {"index": i, "tests": tests}))
    return rows


def problems(min_operand: int, max_operand: int, operators: str) -> list[tuple]:
    operands = range(min_operand, max_operand + 1)
    return [(form, a, op, b) for form in FORMS for op in operators for a in operands for b in operands]


def answer_tokens(max_operand: int) -> int:
    """The longest answer's length in tokens (one a character), <eos> included: rollout.max_new_tokens' floor."""
    return len(PREFIX + python_notation("square", max_operand, "+", max_operand)) + 1


def verbatim(row: PromptRow) -> str:
    """The row's formula copied as it stands (math notation): the warm start's answer when it is not Python."""
    return PREFIX + row.prompt[len("f(x)="):].rstrip("\n")


def sft_batch(rows: list[PromptRow], tokenizer, rng: random.Random):
    """(ids, attention mask, labels) of warm-start examples (module docstring), right-padded; loss on the answer and
    <eos> only."""
    sequences, labels = [], []
    for row in rows:
        answer = row.ground_truth if rng.random() < PYTHON_SHARE else verbatim(row)
        prompt = tokenizer(row.prompt).input_ids
        target = tokenizer(answer).input_ids + [tokenizer.eos_token_id]
        sequences.append(prompt + target)
        labels.append([IGNORE_INDEX] * len(prompt) + target)
    return supervised_batch(sequences, labels, tokenizer.pad_token_id)


@torch.no_grad()
def greedy_answers(model, tokenizer, rows: list[PromptRow]) -> list[str]:
    """Each row's greedy answer, up to <eos> or one token past the longest right answer."""
    longest = max(len(tokenizer(row.ground_truth).input_ids) for row in rows) + 1
    ids, mask = encode_prompts(rows, tokenizer)
    out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device), do_sample=False,
                         max_new_tokens=longest,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return [answer.strip() for answer in tokenizer.batch_decode(out[:, ids.shape[1]:], skip_special_tokens=True)]


def transcription_accuracy(model, tokenizer, rows: list[PromptRow]) -> float:
    """Fraction of rows whose greedy answer is the formula copied right, in Python or verbatim in math notation."""
    answers = greedy_answers(model, tokenizer, rows)
    return sum(answer in (row.ground_truth, verbatim(row)) for answer, row in zip(answers, rows)) / len(rows)


def python_share(model, tokenizer, rows: list[PromptRow]) -> float:
    """Fraction of rows whose greedy answer is the Python translation (near 0 after the warm start)."""
    answers = greedy_answers(model, tokenizer, rows)
    return sum(answer == row.ground_truth for answer, row in zip(answers, rows)) / len(rows)
