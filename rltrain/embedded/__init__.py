"""The embedded default: everything `python -m rltrain.main_grpo` needs with no model, data or network — a
char-level tokenizer and a small Qwen3 (or, with model.embedded.arch, a delta-rule policy) built in code, a seeded
arithmetic task, and a short supervised warm start so that RL starts from a model that is sometimes right."""
