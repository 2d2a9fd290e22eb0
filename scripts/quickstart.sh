#!/usr/bin/env bash
# Quick start, command 1: set up .venv and run the main job, `python -m rltrain.main_grpo`, on its embedded default
# (a small Qwen3 and a synthetic arithmetic task built in code: CPU, no downloads, a few minutes).
#
#   bash scripts/quickstart.sh [Hydra overrides, e.g. trainer.total_steps=10]
#
# Outputs go to outputs/grpo/ (metrics.jsonl, checkpoints/); `python -m rltrain.plot outputs/grpo` draws the curves.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/setup_env.sh"
cd "$root"
exec "${RLTRAIN_VENV:-$root/.venv}/bin/python" -m rltrain.main_grpo "$@"
