#!/usr/bin/env bash
# One device call: install the carried wheels, run the GPU tests, then the benchmarks; logs go to $OUT.
# Usage (device tool, carry [".whl"] made by ../shared/tools/device-wheels.sh):
#   bash benchmarks/run_device.sh [tests|bench|more|final|pendingN|all] [extra pytest args]
#   tests: pytest -m gpu; bench: decode / attention / engine; more: depth, speculation+WCPB, engine profile;
#   final: a tree's GPU tests, the four models and the attention table (~6 minutes)
#   pendingN: what was written but not yet run or timed on a GPU, newest first in the next session's plan
#   (docs/benchmarks.md). Blocks already run, or replaced by a later one, are removed (sessions 24-26); the records
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
  timeout 240 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_pdl.py tests/test_triton_kernels.py \
    tests/test_graphs_gpu.py tests/test_engine_gpu.py tests/test_prefill_tma.py tests/test_gemv.py tests/test_fuse_rmsnorm.py \
    tests/test_fuse_rope_gemv.py > "$OUT/gpu_tests.log" 2>&1
  tail -2 "$OUT/gpu_tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -20
  run timeout 240 python3 -m rlt_compile.bench --model all --eager-steps 1 --compiled-steps 0 --out "$OUT/decode_all.md"
  run timeout 150 python3 benchmarks/attention_bench.py --out "$OUT/attention.md"
fi
if [[ $what == pending92 ]]; then
  # session 27 (issue 3, ~5 min): gluon_fresh on for GQA by default -- the final block's GPU tests with the Gluon ones,
  # then the op's default (and gluon_fresh=0 as the TMA-only baseline) against SDPA and gather + SDPA
  timeout 270 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_pdl.py tests/test_triton_kernels.py \
    tests/test_graphs_gpu.py tests/test_engine_gpu.py tests/test_prefill_tma.py tests/test_prefill_gluon.py tests/test_gemv.py \
    tests/test_fuse_rmsnorm.py tests/test_fuse_rope_gemv.py > "$OUT/gpu_tests.log" 2>&1
  tail -1 "$OUT/gpu_tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -20
  timeout 200 python3 benchmarks/prefill_tma_bench.py --default-tile-only --extra "gluon_fresh=0" \
    --out "$OUT/prefill_default.md" > "$OUT/prefill_default.log" 2>&1
  echo "prefill bench rc=$?"; cut -d'|' -f2-5,8-11 "$OUT/prefill_default.md"
fi
if [[ $what == pending91 ]]; then
  # session 27 (issue 3, ~3 min): out_smem on by default (pending90) -- parity of both prefill kernels, then the op
  # with and without gluon_fresh against SDPA and gather + SDPA in one process
  timeout 200 python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/test_prefill_gluon.py tests/test_prefill_tma.py \
    > "$OUT/gpu_prefill.log" 2>&1
  tail -1 "$OUT/gpu_prefill.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_prefill.log" | head -10
  timeout 250 python3 benchmarks/prefill_tma_bench.py --default-tile-only --extra "gluon_fresh=1" \
    --out "$OUT/prefill_gluon.md" > "$OUT/prefill_gluon.log" 2>&1
  echo "prefill bench rc=$?"; cut -d'|' -f2-5,8-11 "$OUT/prefill_gluon.md"
fi
if [[ $what == pending90 ]]; then
  # session 27 (issue 3, ~2 min): pending89 found the Gluon kernel's output stored 4 bytes at a time (LSU throttle
  # on 8 x 1k) and four CTA barriers per key tile around its TMA copies; out_smem (16-byte stores through shared
  # memory) and one_bar (K and V on one barrier) -- parity, then the kernel alone
  timeout 200 python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/test_prefill_gluon.py > "$OUT/gpu_gluon.log" 2>&1
  tail -1 "$OUT/gpu_gluon.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_gluon.log" | head -10
  timeout 200 python3 benchmarks/gluon_prefill_probe.py \
    --tiles "64,64,3,4;64,64,3,4,1,out_smem=1;64,64,3,4,1,one_bar=1;64,64,3,4,1,one_bar=1,out_smem=1" > "$OUT/probe_out.md" 2>&1
  echo "probe rc=$?"; cat "$OUT/probe_out.md"
fi
if [[ $what == pending89 ]]; then
  # session 27 (issue 3, ~3 min): where the Gluon prefill kernel's time goes on fresh prompts (8 x 1k: ~5.6 us of
  # fixed cost per program by session 26's fit, 1 x 8k) -- Nsight Compute: stall reasons, tensor pipe, SM activity
  for case in "8 1024" "1 8192"; do
    set -- $case
    RLT_ATTENTION_CONFIG=gluon_fresh=1 timeout 150 ncu --kernel-name regex:_fresh_prefill_kernel --launch-skip 2 \
      --launch-count 1 --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
      --section WarpStateStats --section InstructionStats --metrics \
      "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,regex:sm__pipe_tensor.*pct_of_peak_sustained_active,sm__cycles_active.avg,sm__cycles_active.max,gpc__cycles_elapsed.max" \
      python3 benchmarks/attention_case.py --model Nanbeige --batch $1 --ctx $2 --query $2 > "$OUT/ncu_gluon_$1x$2.txt" 2>&1
    echo "== ncu Gluon Nanbeige $1 x $2 rc=$?"
    grep -E "Duration|Compute \(SM\) Throughput|Achieved Occupancy|Warp Cycles Per Issued|Issue Slots Busy|No Eligible|cycles_active|cycles_elapsed|pipe_tensor" \
      "$OUT/ncu_gluon_$1x$2.txt" | head -16
    grep -E "issue_stalled" "$OUT/ncu_gluon_$1x$2.txt" | awk '$NF+0 > 0.05' | sort -k3 -g -r | head -12
  done
fi
if [[ $what == pending85 ]]; then
  # session 26 (issue 4, an H200 only; ~2 min): Ouro-1.4B's headline row with the down projection's 4096-long runs
  # (session 25's default) and its 2048-long runs as a variant
  timeout 200 python3 -m rlt_compile.bench --model ouro-1.4b --eager-steps 1 --compiled-steps 0 \
    --variant "RLT_GEMV_CONFIG=only_n=2048,only_k=5632,block_k=2048" --out "$OUT/decode_ouro.md" > "$OUT/decode_ouro.log" 2>&1
  echo "bench rc=$?"; grep -E "^(\| ouro|ouro|\| (baseline|RLT_))" "$OUT/decode_ouro.md"
fi
if [[ $what == pending61 ]]; then
  # prepared in session 18 (issue 3; its first half, the paging, ran in session 25): split_grain balances the
  # splits of a 1k context too (2 splits: 528 + 497 keys, not 576 + 449)
  timeout 150 python3 benchmarks/attention_bench.py --sweep --no-table --models Nanbeige --cases 16x1024,32x1024,32x8192 \
    --extra "split_grain=16" --out "$OUT/sweep_nb_grain.md" > "$OUT/sweep_nb_grain.log" 2>&1
  grep -E "\| (default|split_grain)" "$OUT/sweep_nb_grain.md"
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
if [[ $what == pending69 ]]; then
  # session 21 (issue 4; its first half, Nanbeige's and Huginn's prefill graphs, ran in session 25): the engine
  # bench's scenarios (16 output tokens) compiled + graphs with and without prefill / mixed-step graphs (~5 min)
  timeout 250 python3 benchmarks/engine_bench.py --modes no-prefill-graphs,compiled --quick --time-limit 20 \
    --warm-time-limit 5 --out "$OUT/engine_prefill_graphs.md" 2>&1 | grep -E "^(\||\[)"
fi
exit 0
