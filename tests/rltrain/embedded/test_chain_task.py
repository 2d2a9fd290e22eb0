"""The embedded chain task (data.task.kind=chain_arithmetic, preset task=chain_arithmetic), in process:

- rows: sums of min_terms to max_terms terms, each worked line a right running total of the prompt's next term, the
  last line `#### <result>`; a disjoint, seeded split; a small space is drawn whole;
- answer_tokens: an upper bound on every worked answer and <eos>, reached by the longest sum;
- tokenizer: `#` added after the default vocabulary, whose ids stay;
- reward: `default` scores a worked answer by its `####` line, as the trainer runs it;
- warm start: labels on the worked answer and <eos> only, the greedy accuracy of a model that answers right or not,
  a few real steps on a tiny model;
- config: the preset composes and passes its own checks; bad keys are refused naming them.

    pytest tests/rltrain/embedded/test_chain_task.py   # a few seconds on 2 cores
"""

import importlib.util
import itertools
import random
import re

import pytest
import torch

from rltrain.config import ConfigError
from rltrain.embedded import chain_task
from rltrain.embedded.config import EmbeddedModelConfig, TaskConfig
from rltrain.embedded.model import build_model, warm_start
from rltrain.embedded.task import make_rows
from rltrain.embedded.tokenizer import build_char_tokenizer
from rltrain.job import load_job_config
from rltrain.rewards.builtin import BUILTIN_REWARDS
from rltrain.workers.batch import IGNORE_INDEX
from tests.rltrain.tiny_job import compose

CHAIN = TaskConfig(kind="chain_arithmetic", min_operand=10, max_operand=99, operators="+", min_terms=3, max_terms=8,
                   num_val=200)
SIGNED = TaskConfig(kind="chain_arithmetic", min_operand=0, max_operand=30, operators="+-", min_terms=2, max_terms=5,
                    num_val=50, seed=3)
LINE = re.compile(r"(-?\d+)([+-])(\d+)=(-?\d+)")


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer(chain_task.CHAIN_CHARS)


def terms(prompt: str) -> tuple[list[int], list[str]]:
    """The prompt's terms and the operators between them."""
    pieces = re.split(r"([+-])", prompt.removesuffix("="))
    return [int(p) for p in pieces[0::2]], pieces[1::2]


@pytest.mark.parametrize("config", [CHAIN, SIGNED], ids=["sums", "signed"])
def test_rows_are_worked_right_line_by_line(config):
    train, val = make_rows(config)
    assert len(train) + len(val) == chain_task.CHAIN_PROBLEMS and len(val) == config.num_val
    assert not {r.prompt for r in train} & {r.prompt for r in val}
    counts = set()
    for row in train[:300] + val:
        numbers, ops = terms(row.prompt)
        counts.add(len(numbers))
        assert config.min_terms <= len(numbers) <= config.max_terms and set(ops) <= set(config.operators)
        assert all(config.min_operand <= n <= config.max_operand for n in numbers)
        assert row.ground_truth == str(eval(row.prompt.removesuffix("=")))   # noqa: S307 (digits and signs only)
        *steps, last = row.extra_info["worked"].split("\n")
        total = numbers[0]
        for line, op, term in zip(steps, ops, numbers[1:], strict=True):
            a, sign, b, c = LINE.fullmatch(line).groups()
            assert (int(a), sign, int(b)) == (total, op, term)
            total = total + term if op == "+" else total - term
            assert int(c) == total
        assert last == f"#### {row.ground_truth}" and row.data_source == chain_task.DATA_SOURCE
    assert counts == set(range(config.min_terms, config.max_terms + 1))
    if "-" in config.operators:
        assert any(int(r.ground_truth) < 0 for r in train)


def test_rows_follow_the_seed_and_a_small_space_is_drawn_whole():
    assert make_rows(CHAIN)[1][:5] == make_rows(CHAIN)[1][:5]
    other = TaskConfig(**{**CHAIN.__dict__, "seed": 1})
    assert [r.prompt for r in make_rows(other)[1]] != [r.prompt for r in make_rows(CHAIN)[1]]
    small = TaskConfig(kind="chain_arithmetic", min_operand=0, max_operand=2, operators="+", min_terms=2,
                       max_terms=3, num_val=4)
    train, val = make_rows(small)
    assert sorted(r.prompt for r in train + val) == sorted(
        "+".join(map(str, p)) + "=" for n in (2, 3) for p in itertools.product(range(3), repeat=n))


@pytest.mark.parametrize("config", [CHAIN, SIGNED], ids=["sums", "signed"])
def test_answer_tokens_bounds_every_answer_and_the_longest_reaches_it(config, tokenizer):
    bound = chain_task.answer_tokens(config)
    rows = make_rows(config)[0]
    assert max(len(tokenizer(r.extra_info["worked"]).input_ids) + 1 for r in rows) <= bound
    if config.operators == "+":
        longest = chain_task.worked(tuple([config.max_operand] + ["+", config.max_operand] * (config.max_terms - 1)))
        assert len(tokenizer(longest[0]).input_ids) + 1 == bound == 85


def test_tokenizer_adds_the_hash_after_the_default_vocabulary(tokenizer):
    default = build_char_tokenizer()
    assert {t: i for t, i in tokenizer.get_vocab().items() if t != "#"} == default.get_vocab()
    assert tokenizer.get_vocab()["#"] == len(default)
    for row in make_rows(SIGNED)[1]:
        ids = tokenizer(row.prompt + row.extra_info["worked"]).input_ids
        assert tokenizer.unk_token_id not in ids
        assert tokenizer.decode(ids) == row.prompt + row.extra_info["worked"]


def test_default_reward_reads_the_answer_line():
    default = BUILTIN_REWARDS.get("default")
    row = make_rows(CHAIN)[1][0]
    worked = row.extra_info["worked"]
    assert default(row.data_source, worked, row.ground_truth) == 1.0
    slipped = worked.rsplit("#### ", 1)[0] + f"#### {int(row.ground_truth) + 1}"
    assert default(row.data_source, slipped, row.ground_truth) == 0.0
    assert default(row.data_source, worked.rsplit("\n", 1)[0], row.ground_truth) == 0.0   # no answer line


def test_sft_batch_trains_on_the_worked_answer_and_eos(tokenizer):
    rows = make_rows(SIGNED)[1][:6]
    ids, mask, labels = chain_task.sft_batch(rows, tokenizer, random.Random(0))
    for row, seq, m, lab in zip(rows, ids.tolist(), mask.tolist(), labels.tolist()):
        prompt = tokenizer(row.prompt).input_ids
        target = tokenizer(row.extra_info["worked"]).input_ids + [tokenizer.eos_token_id]
        n = sum(m)
        assert seq[:n] == prompt + target
        assert lab[:len(prompt)] == [IGNORE_INDEX] * len(prompt) and lab[len(prompt):n] == target


class Answerer(torch.nn.Module):
    """A stand-in for the model's generate(): each prompt's answer from `answer(prompt)`, then <eos>, left-padded
    prompts in, as model.generate returns them."""

    def __init__(self, tokenizer, answer):
        super().__init__()
        self.tokenizer, self.answer = tokenizer, answer
        self.device = torch.device("cpu")   # where the accuracy sends the prompts

    def generate(self, input_ids, attention_mask, max_new_tokens, **_):
        rows = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist()):
            prompt = self.tokenizer.decode([i for i, m in zip(ids, mask) if m])
            rows.append(ids + (self.tokenizer(self.answer(prompt)).input_ids
                               + [self.tokenizer.eos_token_id])[:max_new_tokens])
        width = max(map(len, rows))
        return torch.tensor([r + [self.tokenizer.pad_token_id] * (width - len(r)) for r in rows])


def test_greedy_accuracy_scores_the_answers_by_the_reward(tokenizer):
    rows = make_rows(CHAIN)[1][:4]
    truth = {r.prompt: r.extra_info["worked"] for r in rows}
    assert chain_task.greedy_accuracy(Answerer(tokenizer, truth.get), tokenizer, rows) == 1.0
    wrong = rows[0].prompt
    off = Answerer(tokenizer, lambda p: truth[p] + "1" if p == wrong else truth[p])
    assert chain_task.greedy_accuracy(off, tokenizer, rows) == 0.75


def test_warm_start_trains_a_tiny_model_on_the_worked_answers(tokenizer):
    config = EmbeddedModelConfig(hidden_size=32, num_layers=1, num_heads=2, head_dim=16, warmstart_steps=3,
                                 warmstart_eval_every=3, warmstart_batch_size=8)
    model = build_model(config, tokenizer, 0)
    before = [p.detach().clone() for p in model.parameters()]
    rows = make_rows(SIGNED)[0][:64]
    accuracy = warm_start(model, tokenizer, rows, config, 0, "chain_arithmetic")
    assert 0.0 <= accuracy <= 1.0
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_preset_composes_and_fits_its_longest_answer(monkeypatch):
    find_spec = importlib.util.find_spec   # the preset names vLLM, which the CPU suite's environment lacks
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "vllm" else find_spec(name, *a))
    job = load_job_config(compose("task=chain_arithmetic"))
    assert job.data.task == CHAIN and job.rollout.engine == "vllm" and job.model.embedded.num_layers == 8
    assert job.rollout.max_new_tokens >= chain_task.answer_tokens(job.data.task)
    assert job.trainer.output_dir != load_job_config(compose()).trainer.output_dir


@pytest.mark.parametrize("overrides, message", [
    (["data.task.kind=chain_arithmetic", "data.task.max_operand=99", "data.task.max_terms=8"],
     "rollout.max_new_tokens: must be >= 85 with data.task.kind=chain_arithmetic"),
    (["task=chain_arithmetic", "data.task.operators=+*"],
     "data.task.operators: must be a non-empty subset of '+-' with kind=chain_arithmetic"),
    (["task=chain_arithmetic", "data.task.operators=++"], "data.task.operators: must not repeat an operator"),
    (["task=chain_arithmetic", "data.task.min_terms=1"], "data.task.min_terms: must be >= 2"),
    (["task=chain_arithmetic", "data.task.max_terms=2"], "data.task.max_terms: must be >= min_terms (3)"),
    (["task=chain_arithmetic", "data.task.min_operand=0", "data.task.max_operand=1", "data.task.min_terms=2",
      "data.task.max_terms=2", "data.task.num_val=4"],
     "data.task.num_val: leaves no training problems (the task has 4)"),
], ids=["max-new-tokens", "operators", "repeated-operator", "min-terms", "max-terms", "no-training-rows"])
def test_bad_settings_are_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_job_config(compose(*overrides, "rollout.engine=hf"))
