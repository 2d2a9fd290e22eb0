#!/usr/bin/env bash
# Quick start, command 2: set up .venv and run the whole test suite (CPU; Triton kernels through the interpreter).
#
#   bash scripts/test.sh [pytest args]
#
# On a machine with a CUDA GPU the same suite runs the Triton kernels natively and the @pytest.mark.gpu tests too.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/setup_env.sh"
cd "$root"
exec "${RLTRAIN_VENV:-$root/.venv}/bin/python" -m pytest "$@"
