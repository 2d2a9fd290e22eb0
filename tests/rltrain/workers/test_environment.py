"""Multi-turn episodes against an environment (rollout.multi_turn.env, rltrain/tools/environment.py), in process
with a scripted policy: the example number-guessing game opens each episode, answers each guess with loss-masked
tokens and ends it with its reward on the right guess; max_turns and an environment that raises end episodes (the
latter counted); config errors name the key; and the trainer runs it end to end with reward.name=env."""

import json
from pathlib import Path

import pytest
import ray
import torch

from rltrain.config import ConfigError, from_mapping
from rltrain.embedded.tokenizer import build_char_tokenizer
from rltrain.main_grpo import run
from rltrain.tools import MultiTurnConfig
from rltrain.workers.agent_loop import AgentLoop, episode_metrics
from tests.rltrain.tiny_job import tiny_job
from tests.rltrain.workers.test_agent_loop import ScriptedTurns, _prompts

GAME = str(Path(__file__).resolve().parents[3] / "examples" / "envs" / "guess_number.py")
RAISING = '''
class Broken:
    def reset(self, row):
        return None

    def step(self, action):
        raise RuntimeError("the environment broke")


class Shapeless:
    def reset(self, row):
        return None

    def step(self, action):
        return "higher"   # not (messages, reward, done)
'''


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def _loop(tokenizer, script, env, max_turns=4, max_new_tokens=200):
    config = from_mapping(MultiTurnConfig, {"enabled": True, "max_turns": max_turns, "env": env}, "rollout.multi_turn")
    return AgentLoop(config, ScriptedTurns(tokenizer, script), tokenizer, max_new_tokens)


def test_the_guessing_game(tokenizer):
    """Episode 0 guesses 50, then 70 (secret 70): two turns, reward 1. Episode 1 (secret 12) guesses 50 four times:
    max_turns ends it with reward 0. Every answer is under mask 0, every guess under mask 1."""
    guesses = {"70": ["50", "70"], "12": ["50"] * 4}

    def script(context, turn):
        secret = "70" if context.startswith("a") else "12"
        return guesses[secret][min(context.count("Guess") - 1 + context.count("higher") + context.count("lower"),
                                   len(guesses[secret]) - 1)]

    loop = _loop(tokenizer, script, {"path": GAME, "name": "GuessNumber", "kwargs": {"hint": "Guess"}})
    ids, mask = _prompts(tokenizer, ["a?", "b?"])
    batch = loop.generate(ids, mask, 1, 1.0, seed=0, rows=[{"ground_truth": "70"}, {"ground_truth": "12"}])
    assert batch["env_reward"].tolist() == [1.0, 0.0] and batch["turns"].tolist() == [2, 4]
    messages = batch["messages"].tolist()
    assert [m["content"] for m in messages[0]] == ["Guess", "50", "higher", "70"]
    assert [m["role"] for m in messages[1]] == ["user"] + ["assistant", "user"] * 3 + ["assistant"]
    text = tokenizer.decode(batch["response_ids"][0][batch["response_mask"][0].bool()], skip_special_tokens=True)
    assert text == "5070"   # the model's tokens only; the game's answers are in the response under mask 0
    assert "higher" in tokenizer.decode(batch["response_ids"][0], skip_special_tokens=True)
    assert episode_metrics(batch)["tool/env_errors"] == 0.0


@pytest.mark.parametrize("name", ["Broken", "Shapeless"])
def test_an_environment_that_raises_ends_its_episode(tokenizer, tmp_path, name):
    """A step that raises, or returns something other than (messages, reward, done), ends the episode, counted."""
    path = tmp_path / "broken.py"
    path.write_text(RAISING)
    loop = _loop(tokenizer, lambda context, turn: "1", {"path": str(path), "name": name})
    ids, mask = _prompts(tokenizer, ["a?", "b?"])
    batch = loop.generate(ids, mask, 2, 1.0, seed=0, rows=[{}, {}])
    assert batch["env_errors"].tolist() == [1, 1, 1, 1] and batch["turns"].tolist() == [1, 1, 1, 1]
    assert episode_metrics(batch)["tool/env_errors"] == 4.0


@pytest.mark.parametrize("env, tools, enabled, message", [
    ({"path": "/nonexistent/env.py", "name": "X"}, [], True, "rollout.multi_turn.env.path: no such file"),
    ({"path": GAME, "name": "Missing"}, [], True, "rollout.multi_turn.env.name: 'Missing' is not a class in"),
    ({"path": GAME, "name": "GuessNumber", "kwargs": {"colour": 1}}, [], True,
     "rollout.multi_turn.env.kwargs: GuessNumber"),
    ({"path": GAME, "name": "GuessNumber"}, [{"builtin": "calculator"}], True,
     "rollout.multi_turn.env: answers the model's turns instead of tools"),
    ({"path": GAME, "name": "GuessNumber"}, [], False, "rollout.multi_turn.env: needs rollout.multi_turn.enabled"),
], ids=["file", "name", "kwargs", "with-tools", "disabled"])
def test_config_errors_name_the_key(tmp_path, env, tools, enabled, message):
    with pytest.raises(ConfigError, match="^" + message):
        tiny_job(tmp_path, rollout={"multi_turn": {"enabled": enabled, "tools": tools, "env": env}})


def test_the_trainer_plays_the_game(tmp_path):
    """Two steps of the embedded model against the game (the secret: each problem's answer), reward.name=env: the
    episodes' rewards are the train reward, and validation plays it too."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    try:
        out = tmp_path / "run"
        run(tiny_job(out, trainer={"val_every": 2}, reward={"name": "env"},
                     rollout={"max_new_tokens": 24, "multi_turn": {"enabled": True, "max_turns": 3, "env": {
                         "path": GAME, "name": "GuessNumber", "kwargs": {"hint": ""}}}}))
    finally:
        ray.shutdown()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "train/reward_mean" in r]
    assert len(train) == 2 and all(0 <= r["train/reward_mean"] <= 1 and r["tool/env_errors"] == 0 for r in train)
    assert all(r["tool/turns_per_episode"] >= 1 for r in train)
    assert any("val/reward_mean" in r for r in records)
