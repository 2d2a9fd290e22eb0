"""rltrain: RL post-training for language models (GRPO and kin) on a Ray single controller."""

__version__ = "0.1.0"
