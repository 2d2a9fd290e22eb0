"""Example reward plugin: `reward.path=examples/rewards/math_with_format_bonus.py reward.name=compute_score`.

Same signature as verl's reward functions, so files written for verl work unchanged. Returns a dict: "score" is
the reward; the other numeric entries show up as metrics (reward/<name>_mean).
"""

import re

BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    answers = BOXED.findall(solution_str)
    formatted = bool(answers)
    correct = formatted and answers[-1].strip() == str(ground_truth).strip()
    return {"score": float(correct) + (0.1 if formatted else 0.0), "correct": float(correct),
            "formatted": float(formatted)}
