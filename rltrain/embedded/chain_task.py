"""The embedded chain task (data.task.kind=chain_arithmetic, preset task=chain_arithmetic, sized for one GPU): a sum
of several terms answered with worked steps, one running total a line, then the answer in GSM8K's form, so answers
run to tens or hundreds of tokens and an early slip spoils the end.

    prompt   37+45+18+90=
    answer   37+45=82\\n82+18=100\\n100+90=190\\n#### 190      (the steps the warm start demonstrates)
    reward   `math` on the text after `####` against 190 (any route to the right answer scores 1)

Problems: min_terms to max_terms terms from [min_operand, max_operand], joined by operators drawn from
data.task.operators (a subset of "+-"; running totals may go negative), CHAIN_PROBLEMS distinct ones drawn with the
seed, data.task.num_val of them held out. The warm start (`sft_batch`) trains on the worked answers until greedy
accuracy (`greedy_accuracy`, the reward's own check) reaches model.embedded.warmstart_target_accuracy; RL then
raises it, each line's sum made more reliable by rewarding whole right chains.
"""

from __future__ import annotations

import random

import torch

from rltrain.data.rows import PromptRow
from rltrain.data.sampler import encode_prompts
from rltrain.embedded.config import CHAIN_PROBLEMS
from rltrain.rewards.builtin import math_reward
from rltrain.workers.batch import IGNORE_INDEX, supervised_batch

DATA_SOURCE = "rltrain/chain_arithmetic"
CHAIN_CHARS = "#"        # the answer line's marker, `#### 190`, beyond the default vocabulary


def problems(config) -> list[tuple]:
    """CHAIN_PROBLEMS distinct problems (fewer when the space is smaller), each (a, op, b, op, c, ...), seeded."""
    rng = random.Random(config.seed)
    count = min(CHAIN_PROBLEMS, config.chain_space)
    drawn: dict[tuple, None] = {}
    while len(drawn) < count:
        terms = rng.randint(config.min_terms, config.max_terms)
        problem = [rng.randint(config.min_operand, config.max_operand)]
        for _ in range(terms - 1):
            problem += [rng.choice(config.operators), rng.randint(config.min_operand, config.max_operand)]
        drawn[tuple(problem)] = None
    return list(drawn)


def worked(problem: tuple) -> tuple[str, int]:
    """(the worked answer, the result): one line per operation, `total op term=new total`, then `#### result`."""
    total, lines = problem[0], []
    for op, term in zip(problem[1::2], problem[2::2]):
        new = total + term if op == "+" else total - term
        lines.append(f"{total}{op}{term}={new}")
        total = new
    return "\n".join(lines + [f"#### {total}"]), total


def make_rows(problems_: list[tuple]) -> list[PromptRow]:
    """One row per problem: the expression and `=` as prompt, the result as ground truth, the worked answer in
    extra_info (the warm start's target)."""
    rows = []
    for i, problem in enumerate(problems_):
        solution, result = worked(problem)
        rows.append(PromptRow("".join(map(str, problem)) + "=", DATA_SOURCE, str(result),
                              {"index": i, "worked": solution}))
    return rows


def answer_tokens(config) -> int:
    """The longest worked answer in tokens (one a character), <eos> included: rollout.max_new_tokens' floor. After k
    terms a running total is at most k × max_operand in size (one character more for a minus sign where "-" may
    occur), so the bound is reached by a sum of max_terms terms all at max_operand."""
    sign = "-" in config.operators

    def width(k: int) -> int:   # the widest running total after k terms
        return len(str(k * config.max_operand)) + sign

    lines = sum(width(k - 1) + 1 + len(str(config.max_operand)) + 1 + width(k) + 1   # `total op term=total\n`
                for k in range(2, config.max_terms + 1))
    return lines + len("#### ") + width(config.max_terms) + 1


def sft_batch(rows: list[PromptRow], tokenizer, rng: random.Random):
    """(ids, attention mask, labels) of warm-start examples, right-padded; loss on the worked answer and <eos>."""
    sequences, labels = [], []
    for row in rows:
        prompt = tokenizer(row.prompt).input_ids
        target = tokenizer(row.extra_info["worked"]).input_ids + [tokenizer.eos_token_id]
        sequences.append(prompt + target)
        labels.append([IGNORE_INDEX] * len(prompt) + target)
    return supervised_batch(sequences, labels, tokenizer.pad_token_id)


@torch.no_grad()
def greedy_accuracy(model, tokenizer, rows: list[PromptRow]) -> float:
    """Fraction of rows whose greedy worked answer (up to <eos>, or a token past the longest right one) the reward
    scores right."""
    longest = max(len(tokenizer(row.extra_info["worked"]).input_ids) for row in rows) + 1
    ids, mask = encode_prompts(rows, tokenizer)
    out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device), do_sample=False,
                         max_new_tokens=longest, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    answers = tokenizer.batch_decode(out[:, ids.shape[1]:], skip_special_tokens=True)
    return sum(math_reward(row.data_source, answer, row.ground_truth) for answer, row in zip(answers, rows)) / len(rows)
