python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD/kernels:$PWD/kernels/benchmarks:$PWD:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv -lms 500 > $OUT/clocks.csv &
timeout 560 python kernels/benchmarks/bench_linear_logprobs.py 2>&1 | tee $OUT/lp.log | grep -v "^N=" 
kill %1
