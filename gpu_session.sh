python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD/kernels:$PWD/kernels/benchmarks:$PWD:/tmp/site PYTHONUNBUFFERED=1
python -m pytest -q tests/kernels/ops/test_policy_loss.py -k "scaled or kept or upstream or zero_adv or fully_masked or never_syncs" 2>&1 | tail -1
python kernels/benchmarks/bench_policy_loss.py 2>&1 | tail -14
