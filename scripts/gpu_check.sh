#!/usr/bin/env bash
# The checks a lent GPU machine runs, without Spark or Java (docs/development.md): the GPU
# tests, then the per-step benchmarks on the device. Results and logs go to $OUT.
#
#   bash scripts/gpu_check.sh            # OUT defaults to /tmp/gpu-check
#
# A machine that lacks a dependency takes it from ./.whl (wheels downloaded beforehand).
set -uo pipefail
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name(0))" \
    | tee "$OUT/machine.txt"
status=0
python3 -m pytest -p no:cacheprovider -o addopts="--strict-markers -ra" -m gpu -q \
    tests/unit/test_fsdp.py tests/unit/test_own_loop.py tests/unit/test_tensor_models.py \
    tests/unit/test_device_and_cluster.py 2>&1 | tee "$OUT/gpu_tests.log" || status=1
python3 benchmarks/bench_step.py --device cuda --repeats 3 --output "$OUT/step.json" 2>&1 \
    | tee "$OUT/step.log" || status=1
python3 benchmarks/bench_own_loop.py loop --device cuda --rows 200000 --out "$OUT/own_loop.json" 2>&1 \
    | tee "$OUT/own_loop.log" || status=1
exit $status
