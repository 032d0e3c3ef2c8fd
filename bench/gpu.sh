#!/usr/bin/env bash
# The GPU checks behind bench/GPU.md, from the repository root, on a machine with a CUDA
# build of torch: the engine, worker, decoding and speculation tests with their engines on
# the GPU (SPECSPLIT_TEST_DEVICE=cuda, tests/engine/tiny.py), then `specsplit bench gpu`.
# Logs go to $1 (default bench/results/gpu). The embedded model's tests are left out: they
# fetch it from PyPI.
set -u
out=${1:-bench/results/gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
{
  nvidia-smi
  python3 -c 'import torch, transformers; print(torch.__version__, transformers.__version__)'
  lscpu | head -20
} > "$out/machine.txt" 2>&1
SPECSPLIT_TEST_DEVICE=cuda timeout "${TESTS_S:-300}" python3 -m pytest -q -p no:cacheprovider \
  -n "${WORKERS:-8}" --timeout 120 -rf \
  tests/engine tests/workers tests/decoding tests/speculation \
  --ignore=tests/engine/test_loader.py --ignore=tests/decoding/test_embedded.py \
  > "$out/tests.log" 2>&1
echo "tests rc=$?" >> "$out/tests.log"
timeout "${BENCH_S:-240}" python3 -m workers.tools.cli bench gpu --out "$out" > "$out/bench.log" 2>&1
echo "bench rc=$?" >> "$out/bench.log"
tail -3 "$out/tests.log"
cat "$out/bench.log"
