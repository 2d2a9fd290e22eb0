"""Reward functions: built-in scorers, plugin loading errors, and the pool's handling of misbehaving functions."""

import logging
import textwrap
from pathlib import Path

import pytest

from rltrain.rewards import RewardInput, RewardPool, load_reward_fn
from rltrain.rewards.builtin import BUILTIN_REWARDS, extract_answer, last_boxed

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "rewards" / "math_with_format_bonus.py"


@pytest.mark.parametrize("text, answer", [
    ("so the total is\n#### 1,234", "1,234"),
    ("first \\boxed{3} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("#### 7 but finally \\boxed{8}", "8"),
    ("no answer here", None),
    ("unclosed \\boxed{12", None),
])
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


def test_builtin_scorers():
    math = BUILTIN_REWARDS.get("math")
    assert math("openai/gsm8k", "... #### 1,234", "1234") == 1.0
    assert math("x", "\\boxed{0.50}", "0.5") == 1.0
    assert math("x", "\\boxed{2}", "3") == 0.0
    assert BUILTIN_REWARDS.get("arithmetic")("rltrain/arithmetic", "42\nrest", 42) == 1.0
    assert BUILTIN_REWARDS.get("arithmetic")("rltrain/arithmetic", "421", 42) == 0.0
    default = BUILTIN_REWARDS.get("default")
    assert default("rltrain/arithmetic", "5", "5") == 1.0 and default("unknown/src", "#### 5", "5") == 1.0
    assert last_boxed("\\boxed{a{b}c}") == "a{b}c"


def _plugin(tmp_path, body, name="plugin.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_plugin_loading_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="reward.path: no such file"):
        load_reward_fn(str(tmp_path / "missing.py"), "fn")
    broken = _plugin(tmp_path, "import not_a_real_module_xyz\n", "broken.py")
    with pytest.raises(ImportError, match="broken.py.*failed to import.*ModuleNotFoundError"):
        load_reward_fn(broken, "fn")
    ok = _plugin(tmp_path, "def score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    with pytest.raises(ValueError, match="reward.name: 'fn' is not a function.*functions there: score"):
        load_reward_fn(ok, "fn")
    bad_sig = _plugin(tmp_path, "def fn(a):\n    return 1.0\n", "sig.py")
    with pytest.raises(ValueError, match="must accept"):
        load_reward_fn(bad_sig, "fn")
    with pytest.raises(ValueError, match="unknown built-in reward function 'nope'"):
        load_reward_fn(None, "nope")


def test_example_plugin_loads_and_scores():
    fn = load_reward_fn(str(EXAMPLE), "compute_score")
    assert fn("src", "x \\boxed{4}", "4") == {"score": 1.1, "correct": 1.0, "formatted": 1.0}


def test_pool_scores_and_survives_bad_functions(tmp_path, caplog):
    plugin = _plugin(tmp_path, """
        import time

        def fn(data_source, solution_str, ground_truth, extra_info=None):
            if solution_str == "raise":
                raise RuntimeError("boom")
            if solution_str == "hang":
                time.sleep(60)
            if solution_str == "string":
                return "high"
            if solution_str == "nan":
                return float("nan")
            if solution_str == "dict":
                return {"score": 0.25, "length": 3, "note": "text"}
            return float(solution_str == ground_truth)
    """)
    texts = ["7", "8", "raise", "hang", "string", "nan", "dict", "raise"]
    items = [RewardInput("src", t, "7") for t in texts]
    with caplog.at_level(logging.WARNING, logger="rltrain.rewards.pool"):
        with RewardPool(plugin, "fn", timeout_s=1.0, num_workers=2) as pool:
            result = pool.score(items)
            again = pool.score([RewardInput("src", "7", "7")])  # pool still usable
    assert result.scores == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.25, 0.0]
    assert result.metrics[6] == {"length": 3.0}
    assert result.errors == 5
    assert result.error_kinds == {"error": 4, "timeout": 1}
    assert again.scores == [1.0] and again.errors == 0
    messages = [r.getMessage() for r in caplog.records]
    assert sum("RuntimeError: boom" in m for m in messages) == 1  # logged once, counted twice
    assert any("timed out after 1 s" in m for m in messages)


def test_pool_kills_a_hang_that_ignores_the_timer(tmp_path):
    plugin = _plugin(tmp_path, """
        import time

        def fn(data_source, solution_str, ground_truth, extra_info=None):
            if solution_str == "stubborn":
                while True:
                    try:
                        time.sleep(10)
                    except BaseException:
                        pass
            return 1.0
    """)
    with RewardPool(plugin, "fn", timeout_s=0.5, num_workers=1) as pool:
        result = pool.score([RewardInput("s", "ok", ""), RewardInput("s", "stubborn", "")])
        assert result.scores == [1.0, 0.0] and result.error_kinds == {"timeout": 1}
        assert pool.score([RewardInput("s", "ok", "")]).scores == [1.0]  # rebuilt


def test_pool_validates_arguments(tmp_path):
    with pytest.raises(ValueError, match=r"reward.timeout_s: must be > 0 \(got 0\)"):
        RewardPool(None, "math", timeout_s=0)
    with pytest.raises(ValueError, match="unknown built-in reward function"):
        RewardPool(None, "nope")
