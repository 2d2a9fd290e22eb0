"""The embedded code task (data.task.kind=code_arithmetic, preset task=code_arithmetic), in process:

- rows: formulas of the three forms, a disjoint split, asserts whose values are the formula's at points the prompt
  does not show;
- reward: the rows' Python answers pass in the sandbox (and an equivalent program), the math-notation copies and the
  half-translated ones fail (`3x` does not compile, `x^2` is XOR) — through `default` and the pool as the trainer
  runs them;
- tokenizer: `^` added after the default vocabulary, whose ids stay;
- warm start: examples and labels (Python on about PYTHON_SHARE of them), the transcription accuracy of a model that
  copies perfectly in either notation;
- config: the preset composes; bad keys are refused naming them.

    pytest tests/rltrain/embedded/test_code_task.py   # about 10 s on 2 cores (the sandbox runs)
"""

import random
import re

import pytest
import torch

from rltrain.config import ConfigError
from rltrain.embedded import code_task
from rltrain.embedded.config import TaskConfig
from rltrain.embedded.task import make_rows
from rltrain.embedded.tokenizer import CHARS, SPECIAL, build_char_tokenizer
from rltrain.job import load_job_config
from rltrain.rewards import RewardInput, RewardPool
from rltrain.rewards.builtin import BUILTIN_REWARDS
from rltrain.sandbox import Sandbox
from tests.helpers import sandbox_unavailable
from tests.rltrain.tiny_job import compose

CODE_TASK = TaskConfig(kind="code_arithmetic", min_operand=2, max_operand=19, operators="+-")
NO_SANDBOX = sandbox_unavailable()
needs_sandbox = pytest.mark.skipif(NO_SANDBOX is not None, reason=f"needs a sandbox: {NO_SANDBOX}")
FORMULA = re.compile(r"f\(x\)=(\d+)(x\^2|x|\(x)([+-])(\d+)\)?\n")


def parse(row) -> tuple:
    """(form, a, op, b) of a row's prompt."""
    a, shape, op, b = FORMULA.fullmatch(row.prompt).groups()
    return {"x^2": "square", "x": "linear", "(x": "factored"}[shape], int(a), op, int(b)


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer(code=True)


def test_rows_are_formulas_with_asserts_on_unshown_points():
    train, val = make_rows(CODE_TASK)
    assert len(train) == 3 * 2 * 18 * 18 - 200 and len(val) == 200
    assert not {r.prompt for r in train} & {r.prompt for r in val}
    forms = set()
    for row in train[:100] + val[:100]:
        form, a, op, b = parse(row)
        forms.add(form)
        assert 2 <= a <= 19 and 2 <= b <= 19 and row.data_source == code_task.DATA_SOURCE
        assert row.ground_truth == "f=lambda x:" + code_task.python_notation(form, a, op, b)
        tests = row.extra_info["tests"]
        assert len(tests) == code_task.TEST_POINTS
        for line in tests:
            x, value = map(int, re.fullmatch(r"assert f\((-?\d+)\) == (-?\d+)", line).groups())
            f = eval(row.ground_truth.removeprefix("f="))   # the reference, in process: the tests' values are its
            assert x in code_task.TEST_RANGE and f(x) == value
    assert forms == set(code_task.FORMS)
    assert make_rows(CODE_TASK)[1][0] == val[0]   # seeded


@needs_sandbox
def test_python_passes_and_math_notation_fails_in_the_sandbox():
    score = BUILTIN_REWARDS.get("default")   # by data_source, as reward.name=default would
    sandbox = Sandbox()
    row = next(r for r in make_rows(CODE_TASK)[1] if parse(r)[0] == "square")
    form, a, op, b = parse(row)
    answers = {row.ground_truth: 1.0,
               f"f=lambda x:x*x*{a}{op}{b}": 1.0,                          # another right program
               code_task.verbatim(row): 0.0,                               # `3x`: a SyntaxError
               f"f=lambda x:{a}*x^2{op}{b}": 0.0,                          # runs, but ^ is XOR
               f"f=lambda x:{a}*x**2{op}{b + 1}": 0.0,                     # wrong constant
               f"f=lambda x:{a}*x**2{op}{b}\nimport os\nos._exit(0)": 0.0}  # an early exit skips the asserts
    for answer, expected in answers.items():
        assert score(row.data_source, answer, row.ground_truth, row.extra_info, sandbox=sandbox)["score"] == \
            expected, answer


@needs_sandbox
def test_the_pool_scores_each_sample_in_its_own_sandbox_run():
    """reward.name=code through the RewardPool, as the trainer scores a batch: right and wrong answers side by side
    keep their own scores."""
    rows = make_rows(CODE_TASK)[1][:6]
    answers = [row.ground_truth if i % 2 == 0 else code_task.verbatim(row) for i, row in enumerate(rows)]
    items = [RewardInput(r.data_source, a, r.ground_truth, r.extra_info) for r, a in zip(rows, answers)]
    with RewardPool(None, "code", timeout_s=10.0, num_workers=2) as pool:
        result = pool.score(items)
    assert result.scores == [1.0, 0.0] * 3 and result.errors == 0


def test_tokenizer_adds_the_power_sign_after_the_default_vocabulary(tokenizer):
    default = build_char_tokenizer()
    assert len(tokenizer) == len(default) + 1 == len(SPECIAL + CHARS) + 1
    assert all(tokenizer.convert_tokens_to_ids(t) == default.convert_tokens_to_ids(t) for t in SPECIAL + CHARS)
    for row in make_rows(CODE_TASK)[1][:50]:
        for text in (row.prompt, row.ground_truth, code_task.verbatim(row)):
            ids = tokenizer(text).input_ids
            assert tokenizer.unk_token_id not in ids and tokenizer.decode(ids) == text
    assert default.unk_token_id in default("f(x)=3x^2").input_ids   # why the task needs the flag


def test_warm_start_examples_and_labels(tokenizer):
    rows = make_rows(CODE_TASK)[0][:400]
    ids, mask, labels = code_task.sft_batch(rows, tokenizer, random.Random(0))
    python = 0
    for row, seq, keep, label in zip(rows, ids, mask, labels):
        seq, label = seq[keep.bool()].tolist(), label[keep.bool()].tolist()
        prompt = len(tokenizer(row.prompt).input_ids)
        answer = tokenizer.decode(seq[prompt:])
        assert tokenizer.decode(seq[:prompt]) == row.prompt and all(t == -100 for t in label[:prompt])
        assert label[prompt:] == seq[prompt:] and seq[-1] == tokenizer.eos_token_id
        assert answer in (f"{row.ground_truth}<eos>", f"{code_task.verbatim(row)}<eos>")
        python += answer == f"{row.ground_truth}<eos>"
    assert 35 <= python <= 85   # PYTHON_SHARE 0.15 of 400 = 60


class Copier(torch.nn.Module):
    """A 'model' whose generate writes each prompt's answer as `answer(prompt text)`, then <eos>."""

    def __init__(self, tokenizer, answer):
        super().__init__()
        self.tokenizer, self.answer = tokenizer, answer
        self.device = torch.device("cpu")   # where the accuracy sends the prompts

    def generate(self, input_ids, attention_mask, max_new_tokens, **kwargs):
        tok, out = self.tokenizer, []
        for ids, keep in zip(input_ids, attention_mask):
            new = tok(self.answer(tok.decode(ids[keep.bool()].tolist()))).input_ids + [tok.eos_token_id]
            out.append(ids.tolist() + (new + [tok.pad_token_id] * max_new_tokens)[:max_new_tokens])
        return torch.tensor(out)


def test_transcription_accuracy_counts_right_copies_in_either_notation(tokenizer):
    rows = make_rows(CODE_TASK)[1][:16]
    truth = {row.prompt: row for row in rows}
    python = Copier(tokenizer, lambda prompt: truth[prompt].ground_truth)
    verbatim = Copier(tokenizer, lambda prompt: code_task.verbatim(truth[prompt]))
    assert code_task.transcription_accuracy(python, tokenizer, rows) == 1.0 == code_task.python_share(python, tokenizer,
                                                                                                       rows)
    assert code_task.transcription_accuracy(verbatim, tokenizer, rows) == 1.0
    assert code_task.python_share(verbatim, tokenizer, rows) == 0.0
    wrong = Copier(tokenizer, lambda prompt: truth[prompt].ground_truth + ("1" if prompt in list(truth)[:4] else ""))
    assert code_task.transcription_accuracy(wrong, tokenizer, rows) == 0.75


def test_preset_composes():
    job = load_job_config(compose("task=code_arithmetic"))
    assert job.data.task == CODE_TASK and job.reward.name == "code"
    assert job.rollout.max_new_tokens >= code_task.answer_tokens(19) == len("f=lambda x:19*x**2+19") + 1
    assert job.trainer.output_dir != load_job_config(compose()).trainer.output_dir


@pytest.mark.parametrize("overrides, message", [
    (["data.task.kind=code_arithmetic", "rollout.max_new_tokens=32"],
     "reward.name: must be 'code' with data.task.kind=code_arithmetic (its programs run in the sandbox): select the "
     "preset task=code_arithmetic, or set reward.name=code (got 'default')"),
    (["task=code_arithmetic", "rollout.max_new_tokens=16"],
     "rollout.max_new_tokens: must be >= 22 with data.task.kind=code_arithmetic"),
    (["task=code_arithmetic", "data.task.operators=+*"],
     "data.task.operators: must be a non-empty subset of '+-' with kind=code_arithmetic"),
    (["task=code_arithmetic", "data.task.max_operand=5", "data.task.num_val=96"],
     "data.task.num_val: leaves no training problems (the task has 96)"),
], ids=["reward-name", "max-new-tokens", "operators", "no-training-rows"])
def test_bad_settings_are_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_job_config(compose(*overrides))
