#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment with rltrain and rltrain-kernels installed in editable mode.
#
#   bash scripts/setup_env.sh            # -> .venv (override with RLTRAIN_VENV=/path)
#   RLTRAIN_TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu bash scripts/setup_env.sh   # CPU-only torch
#
# Re-running is a no-op unless a pyproject.toml or this script changed (a stamp file records their hash).
# torch==2.13.0 is installed first: a bare `torch` requirement would pull a multi-GB CUDA build on a CPU machine,
# while an already installed torch that satisfies the pins is kept. RLTRAIN_TORCH_INDEX_URL, when set, is the
# --index-url of that torch install only (its dependencies included; the rest comes from pip's usual index): PyPI's
# Linux torch wheel is the CUDA build, PyTorch's CPU index (https://download.pytorch.org/whl/cpu) has the ~200 MB
# CPU one, which docker/Dockerfile.cpu asks for. Unset: pip's configured index, as before.
# Everything else is pinned by scripts/constraints/main.txt (the versions CI tests); RLTRAIN_UNPINNED=1 resolves
# without it, to upgrade on purpose (that file's header says how).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${RLTRAIN_VENV:-$root/.venv}
python=${PYTHON:-python3}
stamp=$venv/.rltrain-env-hash
constraints=$root/scripts/constraints/main.txt
want=$(cat "$root/pyproject.toml" "$root/kernels/pyproject.toml" "${BASH_SOURCE[0]}" "$constraints" \
    | sha256sum | cut -d' ' -f1)

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$venv/bin/python" ]; then
    exit 0
fi
echo "[setup_env] installing into $venv (first run takes a few minutes)" >&2
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
torch_index=()
if [ -n "${RLTRAIN_TORCH_INDEX_URL:-}" ]; then
    torch_index=(--index-url "$RLTRAIN_TORCH_INDEX_URL")
fi
"$venv/bin/python" -c "import torch" 2>/dev/null || "${pip[@]}" ${torch_index[@]+"${torch_index[@]}"} "torch==2.13.0"
pins=(-c "$constraints")
[ "${RLTRAIN_UNPINNED:-0}" = 1 ] && pins=()
"${pip[@]}" ${pins[@]+"${pins[@]}"} -e "$root/kernels" -e "$root[test]"
echo "$want" > "$stamp"
