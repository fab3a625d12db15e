#!/usr/bin/env bash
# One device call: install the carried wheels, run the GPU tests, then the benchmarks; logs go to $OUT.
# Usage (device tool, carry [".whl"] made by ../shared/tools/device-wheels.sh):
#   bash benchmarks/run_device.sh [tests|bench|more|all] [extra pytest args]
#   tests: pytest -m gpu; bench: decode / attention / engine; more: depth, speculation+WCPB, engine profile
set -uo pipefail
what=${1:-all}; shift || true
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
run() { echo "== $*"; "$@" 2>&1 | tail -40; }
if [[ $what == tests || $what == all ]]; then
  python3 -m pytest -q -m gpu tests -p no:cacheprovider "$@" 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
fi
if [[ $what == bench || $what == all ]]; then
  run python3 benchmarks/attention_bench.py --out "$OUT/attention.md"
  run python3 -m rlt_compile.bench --model all --profile --out "$OUT/decode.md"
  run python3 -m rlt_compile.bench --model ouro-1.4b,nanbeige4.2-3b --passes attention_swap,dot_precision,fuse_linears \
    --eager-steps 0 --compiled-steps 0 --profile --out "$OUT/decode_fused.md"
  run python3 benchmarks/engine_bench.py --eager-time-limit 2 --out "$OUT/engine.md"
fi
if [[ $what == more || $what == all ]]; then
  run python3 benchmarks/depth_bench.py --out "$OUT/depth.md"
  run python3 benchmarks/spec_bench.py --out "$OUT/spec.md"
  run python3 -m rlt_compile.bench --engine-profile --model ouro-1.4b --out "$OUT/engine_profile.md"
  run python3 benchmarks/serve_bench.py --engine-baseline --out "$OUT/serve.md"
fi
exit 0
