"""Reward plug-in of the chat-arithmetic example: 1 when the response's last integer is the answer, else 0.

    reward.path=examples/chat_arithmetic/reward.py reward.name=compute_score

The last integer, not the whole text: a chat model may write "37+45 = 82" or think first (Qwen3's <think> block).
"""

import re

INTEGER = re.compile(r"-?\d+")


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    numbers = INTEGER.findall(solution_str)
    return float(bool(numbers) and numbers[-1] == str(ground_truth).strip())
