#!/usr/bin/env bash
# One device call: install the carried wheels, run the GPU tests, then the benchmarks; logs go to $OUT.
# Usage (device tool, carry [".whl"] made by ../shared/tools/device-wheels.sh):
#   bash benchmarks/run_device.sh [tests|bench|more|final|pendingN|all] [extra pytest args]
#   tests: pytest -m gpu; bench: decode / attention / engine; more: depth, speculation+WCPB, engine profile;
#   final: a tree's GPU tests, the four models and the attention table (~6 minutes)
#   pendingN: what was written but not yet run or timed on a GPU, newest first in the next session's plan
#   (docs/benchmarks.md). Blocks already run, or replaced by a later one, are removed (sessions 24-30); the records
#   in docs/benchmarks.md name their block, and `git log -S pendingN -- benchmarks/run_device.sh` finds it.
set -uo pipefail
what=${1:-all}; shift || true
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  > "$OUT/pip.log" 2>&1
# sessions 19 and 22: a wheel was missing after the line above (expecttest, then fastapi) without a word;
# check the imports the tests need and install wheel by wheel where one is missing
if ! PYTHONPATH=/tmp/site python3 -c "import expecttest, depyf, fastapi, uvicorn" 2>>"$OUT/pip.log"; then
  for wheel in .whl/*.whl; do
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$wheel" >> "$OUT/pip.log" 2>&1
  done
  PYTHONPATH=/tmp/site python3 -c "import expecttest, depyf, fastapi, uvicorn" || echo "wheels missing: $OUT/pip.log"
fi
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
if [[ $what == final ]]; then
  # a session's final tree: GPU tests (logs in $OUT), then the four models and the attention table (issues 3, 4)
  timeout 330 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_pdl.py tests/test_triton_kernels.py \
    tests/test_graphs_gpu.py tests/test_engine_gpu.py tests/test_prefill_tma.py tests/test_prefill_gluon.py tests/test_gemv.py \
    tests/test_fuse_rmsnorm.py \
    tests/test_fuse_rope_gemv.py > "$OUT/gpu_tests.log" 2>&1
  tail -2 "$OUT/gpu_tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -20
  run timeout 240 python3 -m rlt_compile.bench --model all --eager-steps 1 --compiled-steps 0 --out "$OUT/decode_all.md"
  run timeout 150 python3 benchmarks/attention_bench.py --out "$OUT/attention.md"
fi
if [[ $what == pending103 ]]; then
  # session 32 (issue 3, ~3 min): the long-prompt tile's GPU parity in the op, then the attention table on the new
  # default (prefill 1 x 8k now on 128-row tiles) against SDPA and gather + SDPA
  timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_prefill_gluon.py -k "long" \
    > "$OUT/long_tests.log" 2>&1; echo "tests rc=$?"; tail -2 "$OUT/long_tests.log"
  timeout 170 python3 benchmarks/attention_bench.py --out "$OUT/attention.md" > "$OUT/attention.log" 2>&1
  echo "attention rc=$?"; cat "$OUT/attention.md" 2>/dev/null || tail -5 "$OUT/attention.log"
fi
if [[ $what == pending100 ]]; then
  # session 32 (issue 3, ~3 min): Nsight Compute on the Gluon kernel in the op, 1 x 8k prompts, on the long-prompt
  # tile (the default there) and on the 64-row tile: tensor-pipe activity, L2 and shared-memory throughput, stalls
  for run in Nanbeige: Ouro: Nanbeige:gluon_block=64; do
    model=${run%%:*}; cfg=${run#*:}; tag=$model${cfg:+_64}
    RLT_ATTENTION_CONFIG=$cfg timeout 150 ncu --kernel-name regex:_gluon_prefill_kernel --launch-skip 2 --launch-count 1 \
      --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
      --section WarpStateStats --section InstructionStats --section Occupancy \
      python3 benchmarks/attention_case.py --model $model --batch 1 --ctx 8192 --query 8192 > "$OUT/ncu_gluon_$tag.txt" 2>&1
    echo "== ncu $tag rc=$?"
    grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|L2 Cache Throughput|L1/TEX Cache Throughput|\
Executed Ipc A|Issue Slots Busy|Warp Cycles Per Issued|Achieved Occupancy|Executed Instructions  " "$OUT/ncu_gluon_$tag.txt" | head -12
  done
fi
if [[ $what == pending98 ]]; then
  # session 30 (issues 3, 4; ~3 min): prefill steps of the real models captured in graphs, on the Gluon kernel
  # (head dim 128); each replay checked against the step on the same padded batch
  for model in ouro-1.4b nanbeige4.2-3b; do
    timeout 150 python3 benchmarks/prefill_graph_bench.py --model $model --lengths 16,128,512,2000 --mixed 15 \
      --reps 3 --out "$OUT/prefill_graphs_$model.md" > "$OUT/prefill_graphs_$model.log" 2>&1
    echo "prefill graphs $model rc=$?"; cat "$OUT/prefill_graphs_$model.md" 2>/dev/null || tail -5 "$OUT/prefill_graphs_$model.log"
  done
fi
if [[ $what == pending85 ]]; then
  # session 26 (issue 4, an H200 only; ~2 min): Ouro-1.4B's headline row with the down projection's 4096-long runs
  # (session 25's default) and its 2048-long runs as a variant
  timeout 200 python3 -m rlt_compile.bench --model ouro-1.4b --eager-steps 1 --compiled-steps 0 \
    --variant "RLT_GEMV_CONFIG=only_n=2048,only_k=5632,block_k=2048" --out "$OUT/decode_ouro.md" > "$OUT/decode_ouro.log" 2>&1
  echo "bench rc=$?"; grep -E "^(\| ouro|ouro|\| (baseline|RLT_))" "$OUT/decode_ouro.md"
fi
if [[ $what == pending63 ]]; then
  # prepared in session 18 (issue 3): where the TMA prefill's key loop stalls, with and without its softmax
  # option fold_scale (the scale inside the exponent's FMA; on by default since session 25, which timed it);
  # Nsight Compute on the 1 x 8k kernel (~3 min)
  for cfg in "" fold_scale=0; do
    tag=${cfg//[=,]/_}
    RLT_ATTENTION_CONFIG=$cfg timeout 120 ncu --kernel-name regex:_prefill_tma_kernel --launch-skip 2 --launch-count 1 \
      --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section InstructionStats \
      python3 benchmarks/attention_case.py --model Ouro --batch 1 --ctx 8192 --query 8192 > "$OUT/ncu_prefill${tag}.txt" 2>&1
    echo "== ncu $cfg rc=$?"
    grep -E "Duration|Compute \(SM\) Throughput|Executed Ipc A|Issue Slots Busy|Warp Cycles Per Issued|Executed Instructions  " \
      "$OUT/ncu_prefill${tag}.txt" | head -8
  done
fi
exit 0
