"""Reward functions: built-in scorers, plugin loading errors and the example plug-in (the pool: test_pool.py)."""

import textwrap
from pathlib import Path

import pytest

from rltrain.rewards import load_reward_fn
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
