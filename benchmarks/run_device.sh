#!/usr/bin/env bash
# One device call: install the carried wheels, run the GPU tests, then the benchmarks; logs go to $OUT.
# Usage (device tool, carry [".whl"]): bash benchmarks/run_device.sh [tests|bench|all] [extra pytest args]
set -uo pipefail
what=${1:-all}; shift || true
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
if [[ $what == tests || $what == all ]]; then
  python3 -m pytest -q -m gpu tests -p no:cacheprovider "$@" 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
fi
if [[ $what == bench || $what == all ]]; then
  [[ -f benchmarks/attention_bench.py ]] && python3 benchmarks/attention_bench.py --out "$OUT/attention.md" 2>&1 | tail -40
  python3 -m rlt_compile.bench --model all --out "$OUT/decode.md" 2>&1 | tail -40
  [[ -f benchmarks/engine_bench.py ]] && python3 benchmarks/engine_bench.py --out "$OUT/engine.md" 2>&1 | tail -40
fi
exit 0
