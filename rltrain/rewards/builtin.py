"""Built-in reward functions (verl's signature): exact-answer scoring for math-style outputs.

- `math`: extracts the final answer from `#### 42` (GSM8K style) or the last `\\boxed{...}` and compares it with
  the ground truth (numerically when both parse as numbers, else as normalised strings). 1.0 or 0.0.
- `arithmetic`: the embedded task's scorer: the response's text up to the first newline or end-of-text must be the
  ground-truth integer.
- `tool_arithmetic`: the embedded tool task's scorer: the same check on the final answer, the text after the last
  `</tool_response>` (the whole response when no tool was called).
- `code`: runs the program in the response against the row's tests in the sandbox (rltrain/rewards/code.py); the
  embedded code task's scorer (data_source "rltrain/code_arithmetic").
- `default`: picks by `data_source` (known sources below), falling back to `math`.
"""

from __future__ import annotations

import re

from rltrain.registry import Registry
from rltrain.rewards.code import code_reward

BUILTIN_REWARDS: Registry = Registry("built-in reward function")

_HASH_ANSWER = re.compile(r"####\s*(.+)")


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (nested braces allowed), or None."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j]
    return None


def extract_answer(text: str) -> str | None:
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    matches = _HASH_ANSWER.findall(text)
    return matches[-1] if matches else None


def normalize(answer: str) -> str:
    answer = answer.strip().strip("$").strip()
    answer = answer.rstrip(".").replace(",", "").replace(" ", "")
    return answer


def answers_match(answer: str, ground_truth) -> bool:
    a, g = normalize(answer), normalize(str(ground_truth))
    try:
        return abs(float(a) - float(g)) <= 1e-6 * max(1.0, abs(float(g)))
    except ValueError:
        return a == g


@BUILTIN_REWARDS.register("math")
def math_reward(data_source, solution_str, ground_truth, extra_info=None) -> float:
    answer = extract_answer(solution_str)
    return float(answer is not None and answers_match(answer, ground_truth))


@BUILTIN_REWARDS.register("arithmetic")
def arithmetic_reward(data_source, solution_str, ground_truth, extra_info=None) -> float:
    answer = solution_str.split("\n", 1)[0].strip()
    return float(answer == str(ground_truth).strip())


@BUILTIN_REWARDS.register("tool_arithmetic")
def tool_arithmetic_reward(data_source, solution_str, ground_truth, extra_info=None) -> float:
    return arithmetic_reward(data_source, solution_str.rpartition("</tool_response>")[2], ground_truth)


DATA_SOURCE_REWARDS = {
    "rltrain/arithmetic": "arithmetic",
    "rltrain/tool_arithmetic": "tool_arithmetic",
    "rltrain/chain_arithmetic": "math",   # the embedded chain task answers `#### 190`
    "openai/gsm8k": "math",
    "lighteval/MATH": "math",
    "DigitalLearningGmbH/MATH-lighteval": "math",
}


@BUILTIN_REWARDS.register("env")
def env_reward(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """An environment's episode reward (rollout.multi_turn.env: the sum of its steps' rewards), or an agent's
    (rollout.multi_turn.agent: its return value)."""
    if not extra_info or "env_reward" not in extra_info:
        raise ValueError("reward.name=env reads extra_info['env_reward'], which only the episodes of an environment "
                         "(rollout.multi_turn.env) or of an agent that returned a reward (rollout.multi_turn.agent) "
                         "carry")
    return float(extra_info["env_reward"])


@BUILTIN_REWARDS.register("default")
def default_reward(data_source, solution_str, ground_truth, extra_info=None, sandbox=None) -> float:
    name = DATA_SOURCE_REWARDS.get(data_source, "math")
    if name in SANDBOXED_REWARDS:
        return BUILTIN_REWARDS.get(name)(data_source, solution_str, ground_truth, extra_info, sandbox=sandbox)
    return BUILTIN_REWARDS.get(name)(data_source, solution_str, ground_truth, extra_info)


# -- code: runs the response's program in the sandbox (rltrain/rewards/code.py); `default` picks it for the data
# sources verl scores with prime_code, and for "code". The sandbox it gets is reward.sandbox's (rewards/plugin.py).
BUILTIN_REWARDS.register("code")(code_reward)
SANDBOXED_REWARDS = ("code",)
DATA_SOURCE_REWARDS.update({source: "code" for source in ("code", "codecontests", "apps", "codeforces", "taco",
                                                          "rltrain/code_arithmetic")})
