"""The generative judge (reward.judge, rltrain/workers/judge.py): the yes_no verdict against the judge model's own
first-token probabilities (a Qwen3-layout release fixture with its chat template), the score parser, failed verdicts
scoring 0, template errors naming the key, the trainer adding the judge's scores (rule_weight, weight) with its
timeout scoring a batch 0, and the judge asked while the reward function is still scoring."""

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import ray
import torch

from rltrain.config import ConfigError
from rltrain.main_grpo import run
from rltrain.rewards.combine import Scorers, score_batch
from rltrain.rewards.health import RewardStats
from rltrain.workers.judge import DEFAULT_TEMPLATE, NO, YES, JudgeConfig, JudgeWorker, first_token_ids, parse_score
from tests.fixtures.releases import build_release
from tests.rltrain.tiny_job import record_started_roles, tiny_job

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "rewards"
PROMPTS = ["What is 12 + 7?", [{"role": "user", "content": "What is 3 * 4?"}], "Name a colour."]
RESPONSES = ["19", "The answer is 13.", "Blue"]
TRUTHS = ["19", "12", None]


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    return build_release("qwen3", tmp_path_factory.mktemp("judge") / "qwen3")


def test_yes_no_is_the_judges_first_token_probability(release):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    judge = JudgeWorker(JudgeConfig(path=release, micro_batch_size=2), release, "float32")
    scores, failed = judge.score(PROMPTS, RESPONSES, TRUTHS)
    assert not failed.any() and scores.shape == (3,)
    tokenizer = AutoTokenizer.from_pretrained(release)
    model = AutoModelForCausalLM.from_pretrained(release, dtype=torch.float32)
    yes, no = first_token_ids(tokenizer, YES), first_token_ids(tokenizer, NO)
    yes, no = sorted(set(yes) - set(no)), sorted(set(no) - set(yes))   # a lone space begins both: neither
    assert yes and no and judge.yes == yes and judge.no == no
    for i, (prompt, response, truth) in enumerate(zip(PROMPTS, RESPONSES, TRUTHS)):
        text = judge.render(prompt, response, truth)
        assert "<|im_start|>user" in text and text.endswith("<|im_start|>assistant\n")   # the chat template
        assert response in text and (truth is None or f"Reference answer: {truth}" in text)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
        probs = torch.softmax(model(ids).logits[0, -1].double(), -1)
        expected = probs[yes].sum() / (probs[yes].sum() + probs[no].sum())
        assert scores[i].item() == pytest.approx(expected.item(), abs=1e-5)


def test_score_parser_and_failed_verdicts(release):
    assert parse_score("Score: 8/10", 10) == 0.8 and parse_score("12", 10) == 1.0 and parse_score("-3", 10) == 0.0
    assert parse_score("7.5 out of 10", 10) == 0.75 and parse_score("no number here", 10) is None
    judge = JudgeWorker(JudgeConfig(path=release, parser="score", max_new_tokens=4), release, "float32")
    replies = iter(["8", "great", "Score: 3"])
    judge.tokenizer.batch_decode = lambda ids, **kwargs: [next(replies) for _ in range(len(ids))]
    scores, failed = judge.score(PROMPTS, RESPONSES, TRUTHS)
    assert scores.tolist() == pytest.approx([0.8, 0.0, 0.3]) and failed.tolist() == [False, True, False]


def test_template_errors_name_the_key(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text("Judge {answer} please")
    with pytest.raises(ConfigError, match=r"^reward.judge.template: .*bad.txt: a placeholder other than"):
        JudgeConfig(path="policy", template=str(bad)).validate()
    with pytest.raises(ConfigError, match=r"^reward.judge.template: cannot read '.*missing.txt'"):
        JudgeConfig(path="policy", template=str(tmp_path / "missing.txt")).validate()
    with pytest.raises(ConfigError, match=r"^reward.judge.placement: must be one of colocated, separate"):
        tiny_job(tmp_path, reward={"judge": {"path": "policy", "placement": "remote"}})
    assert JudgeConfig(path="policy").memory_share == 0.2
    assert JudgeConfig(path="policy", placement="separate").memory_share == 0.85
    assert JudgeConfig(path="policy", placement="separate", gpu_memory_utilization=0.5).memory_share == 0.5
    with pytest.raises(ConfigError, match=r"^reward.judge.parser: must be one of yes_no, score"):
        tiny_job(tmp_path, reward={"judge": {"path": "policy", "parser": "likert"}})
    assert "{prompt}" in DEFAULT_TEMPLATE and "{response}" in DEFAULT_TEMPLATE
    for example in ("judge_correct.txt", "judge_rate.txt"):   # the examples the docs name
        JudgeConfig(path="policy", template=str(EXAMPLES / example)).validate()


@pytest.fixture(scope="module")
def ray_session():
    ray.init(address="local", num_cpus=3, include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield
    ray.shutdown()


def _train(output_dir) -> list[dict]:
    return [r for r in map(json.loads, (output_dir / "metrics.jsonl").read_text().splitlines())
            if "train/reward_mean" in r]


def test_the_trainer_adds_the_judges_scores(tmp_path, ray_session, monkeypatch):
    """The policy as its own judge (the embedded model: yes_no over its char tokenizer's Y / N), the function's reward
    weighted 0: the train reward is the judge's score, here from a CPU of the judge's own (placement=separate); a
    timeout too short for any verdict scores every sample 0."""
    placements = {}
    record_started_roles(monkeypatch, placements)
    out = tmp_path / "run"
    run(tiny_job(out, reward={"judge": {"path": "policy", "rule_weight": 0.0, "weight": 1.0,
                                        "placement": "separate"}}))
    assert placements["JudgeWorker"] is not placements["ActorWorker"]
    assert placements["JudgeWorker"].ranks_per_node == 1 and placements["JudgeWorker"].groups == []  # released
    for record in _train(out):
        assert 0 < record["reward/judge_mean"] < 1 and record["reward/judge_failed_mean"] == 0.0
        assert record["train/reward_mean"] == pytest.approx(record["reward/judge_mean"], abs=1e-6)
    late = tmp_path / "late"
    run(tiny_job(late, reward={"judge": {"path": "policy", "rule_weight": 0.0, "timeout_s": 1e-3}}))
    for record in _train(late):
        assert record["reward/judge_failed_mean"] == 1.0 and record["train/reward_mean"] == 0.0


@ray.remote(num_cpus=0)
class Clocked:
    """A scorer that returns `result` after `seconds`, and tells when its call ran."""

    def __init__(self, result, seconds: float):
        self.result, self.seconds, self.ran = result, seconds, None

    def score(self, *args):
        started = time.monotonic()
        time.sleep(self.seconds)
        self.ran = (started, time.monotonic())
        return self.result

    timed_score = score   # the judge's name for it (its result carries its seconds)

    def times(self):
        return self.ran


def test_the_judge_scores_while_the_function_does(ray_session):
    """score_batch asks the judge before the reward function has answered (each in its own process), then blends:
    rule_weight · function + weight · judge; a judge slower than timeout_s scores 0 (its own time, which a fake
    judge reports)."""
    function = Clocked.remote((torch.ones(2), [{}, {}], RewardStats(2)), 1.0)
    judge = Clocked.remote((torch.tensor([0.5, 0.25]), torch.tensor([False, True]), 0.0), 0.0)
    ray.get([function.times.remote(), judge.times.remote()])   # both processes up before the clock matters
    scorers = Scorers(reward=function, judge=judge)
    config = SimpleNamespace(judge=JudgeConfig(path="policy", rule_weight=2.0, weight=1.0))
    rows = [SimpleNamespace(prompt="p", ground_truth="g")] * 2
    rewards, extras, errors = score_batch(scorers, config, ["a", "b"], rows, None, None)
    assert rewards.tolist() == [2.5, 2.25] and errors.samples == 2
    assert [e["judge"] for e in extras] == [0.5, 0.25] and [e["judge_failed"] for e in extras] == [0.0, 1.0]
    (_, function_end), (judge_start, _) = ray.get([function.times.remote(), judge.times.remote()])
    assert judge_start < function_end
    # verdicts that took the judge longer than timeout_s score 0, however long the function took beside them
    scorers = scorers._replace(judge=Clocked.remote((torch.tensor([0.5, 0.25]), torch.tensor([False, False]), 0.7),
                                                    0.0))
    config.judge.timeout_s = 0.5
    rewards, extras, _ = score_batch(scorers, config, ["a", "b"], rows, None, None)
    assert rewards.tolist() == [2.0, 2.0] and [e["judge_failed"] for e in extras] == [1.0, 1.0]
