"""The embedded default: everything `python -m rltrain.main_grpo` needs with no model, data or network — a
char-level tokenizer and a small Qwen3 (or, with model.embedded.arch, a delta-rule policy) built in code, a seeded
arithmetic task, and a short supervised warm start so that RL starts from a model that is sometimes right. The
tool task (preset task=tool_arithmetic: 2-digit products with the calculator tool) is in task.py and tool_task.py, the
code task (preset task=code_arithmetic: formulas written as Python programs, run in the sandbox) in code_task.py."""
