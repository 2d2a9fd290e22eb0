#!/usr/bin/env bash
# Quick start, command 1: set up .venv and run the main job on its embedded default.
#
#   bash scripts/quickstart.sh [args passed to the job]
#
# Until the GRPO trainer lands (issue 7), the main job is the kernel demo: a small Qwen3 built from its config,
# the default kernels swapped in, and a table showing that logits and gradients match the unpatched model.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/setup_env.sh"
exec "${RLTRAIN_VENV:-$root/.venv}/bin/python" "$root/examples/kernel_demo.py" "$@"
