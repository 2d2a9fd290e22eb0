"""A number-guessing game as a multi-turn environment (rollout.multi_turn.env, rltrain/tools/environment.py): the
secret is the row's ground truth, the model guesses a number each turn, and the environment answers "higher",
"lower" or ends the episode with reward 1 on the right guess (0 if the turns run out).

    python -m rltrain.main_grpo rollout.multi_turn.enabled=true rollout.multi_turn.max_turns=6 \
        rollout.multi_turn.env.path=examples/envs/guess_number.py rollout.multi_turn.env.name=GuessNumber \
        reward.name=env
"""

import re

NUMBER = re.compile(r"-?\d+")


class GuessNumber:
    def __init__(self, hint: str = "Guess the number."):
        self.hint, self.secret = hint, None

    def reset(self, row: dict):
        """The secret from the row; the hint opens the episode after the prompt."""
        self.secret = int(str(row["ground_truth"]).strip())
        return [{"role": "user", "content": self.hint}] if self.hint else None

    def step(self, action: str):
        """(the answer to a guess, its reward, whether the game is over)."""
        found = NUMBER.search(action)
        if found is None:
            return [{"role": "user", "content": "a number, please"}], 0.0, False
        guess = int(found.group())
        if guess == self.secret:
            return None, 1.0, True
        return [{"role": "user", "content": "higher" if guess < self.secret else "lower"}], 0.0, False
