#!/usr/bin/env bash
# One device call: install the carried wheels, run the GPU tests, then the benchmarks; logs go to $OUT.
# Usage (device tool, carry [".whl"] made by ../shared/tools/device-wheels.sh):
#   bash benchmarks/run_device.sh [tests|bench|more|final|pendingN|all] [extra pytest args]
#   tests: pytest -m gpu; bench: decode / attention / engine; more: depth, speculation+WCPB, engine profile;
#   final: a tree's GPU tests, the four models and the attention table (~6 minutes)
#   pendingN: what was written but not yet run or timed on a GPU, newest first in the next session's plan
#   (docs/benchmarks.md). Blocks already run, or replaced by a later one, were removed in session 24; the records
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
if [[ $what == pending81 ]]; then
  # session 24 (issue 4, ~7 min): what pending77-80 and pending62 were to measure, as in-process variants
  # (bench --variant: one build and compile per model, graphs recaptured per config, baseline interleaved).
  # GPU tests of the GEMV (the down projection's new default tile), the engine (prefill graphs on by
  # default) and its self-speculation; the headline table with eager; the GEMV tiles before sessions 22/23
  # (o and down, and down alone), Ouro's q/k/v and gate/up with 2048-long runs, the 4-column tile on
  # Nanbeige's o and down (768 programs, all resident); Ouro-1.4B's decode attention options (the prefill
  # buckets' capture: pending83)
  timeout 150 python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/test_gemv.py tests/test_engine_gpu.py \
    tests/test_engine_speculative.py > "$OUT/gpu_tests.log" 2>&1
  tail -1 "$OUT/gpu_tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head
  wide="block_n=4,block_k=2048,warps=8"
  old_down="only_n=2048,only_k=5632,block_n=2,warps=4"
  old_o="only_n=2048,only_k=2048,block_n=2,block_k=1024,warps=4"
  timeout 240 python3 -m rlt_compile.bench --model ouro-1.4b,ouro-2.6b,nanbeige4.2-3b --eager-steps 1 --compiled-steps 0 \
    --variant "RLT_GEMV_CONFIG=$old_down" --variant "RLT_GEMV_CONFIG=$old_o;$old_down" \
    --variant "RLT_GEMV_CONFIG=only_n=6144,only_k=2048,block_k=2048" \
    --variant "RLT_GEMV_CONFIG=only_n=11264,only_k=2048,block_k=2048" \
    --variant "RLT_GEMV_CONFIG=only_n=3072,only_k=6144,$wide;only_n=3072,only_k=10752,$wide" \
    --out "$OUT/bench_variants.md" > "$OUT/bench_variants.log" 2>&1
  echo "bench rc=$?"; grep -E "^(\| (ouro|nanbeige|huginn)|ouro|nanbeige|\| (baseline|RLT_))" "$OUT/bench_variants.md"
  timeout 90 python3 -m rlt_compile.bench --model huginn-0125 --eager-steps 1 --compiled-steps 0 2>&1 \
    | grep -E "^\| huginn" | head -1
  # a cheap sweep of the other GEMV knobs per Ouro projection (q/k/v, gate/up: warps, stages, 4 columns
  # of 1024-long runs in 4 warps; o, down: the 4-column tile with 4 warps, and down with 1024- and 4096-long
  # runs: more of its row read before the PDL wait)
  qkv="only_n=6144,only_k=2048"; gate_up="only_n=11264,only_k=2048"; o="only_n=2048,only_k=2048"
  down="only_n=2048,only_k=5632"
  timeout 120 python3 -m rlt_compile.bench --model ouro-1.4b --eager-steps 0 --compiled-steps 0 \
    --variant "RLT_GEMV_CONFIG=$qkv,warps=8" --variant "RLT_GEMV_CONFIG=$qkv,stages=2" \
    --variant "RLT_GEMV_CONFIG=$gate_up,warps=8" --variant "RLT_GEMV_CONFIG=$gate_up,stages=2" \
    --variant "RLT_GEMV_CONFIG=$o,warps=4" --variant "RLT_GEMV_CONFIG=$down,warps=4" \
    --variant "RLT_GEMV_CONFIG=$down,block_k=1024" --variant "RLT_GEMV_CONFIG=$down,block_k=4096" \
    --variant "RLT_GEMV_CONFIG=$qkv,block_n=4" \
    --variant "RLT_GEMV_CONFIG=$gate_up,block_n=4" 2>&1 | grep -E "^\| (baseline|RLT_)" | head -11
  timeout 80 python3 -m rlt_compile.bench --model ouro-1.4b --eager-steps 0 --compiled-steps 0 \
    --variant RLT_ATTENTION_CONFIG=early_exit=1 --variant RLT_ATTENTION_CONFIG=splits=16 \
    --variant RLT_ATTENTION_CONFIG=splits=64 --variant RLT_ATTENTION_CONFIG=block_n=64 \
    --variant RLT_ATTENTION_CONFIG=block_n=32 2>&1 | grep -E "^\| (baseline|RLT_)" | head -6
fi
if [[ $what == pending82 ]]; then
  # session 24 (issue 3, ~8 min): the attention table with the gather + SDPA columns (session 22), the Gluon
  # prefill probe, then pending63's TMA prefill softmax options (fold_scale, rescale_slack): GPU parity and
  # the op's time
  timeout 200 python3 benchmarks/attention_bench.py --out "$OUT/attention.md" > "$OUT/attention.log" 2>&1
  echo "attention_bench rc=$?"; grep -E "^\|" "$OUT/attention.md" | head -60
  # session 24: the Gluon prefill probe (FlashAttention-3's order: the PV product in flight during the softmax),
  # parity with SDPA and TFLOP/s for three tile configs against SDPA on fresh causal prompts
  timeout 150 python3 benchmarks/gluon_prefill_probe.py > "$OUT/gluon_prefill.log" 2>&1
  echo "gluon probe rc=$?"; grep -E "^(\||bf16|error|Traceback)" "$OUT/gluon_prefill.log"; tail -3 "$OUT/gluon_prefill.log"
  timeout 90 python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/test_prefill_tma.py > "$OUT/gpu_tests.log" 2>&1
  tail -1 "$OUT/gpu_tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head
  timeout 200 python3 benchmarks/prefill_tma_bench.py --default-tile-only \
    --extra "fold_scale=1;rescale_slack=8;fold_scale=1,rescale_slack=8" --out "$OUT/prefill_softmax.md" 2>&1 | grep "^|"
fi
if [[ $what == pending83 ]]; then
  # session 20's short-context tile sweep around the 256-position threshold (pending66's last part, which
  # ran past its 150 s limit on an H100), then the default prefill buckets' capture (~6 min)
  timeout 230 python3 benchmarks/attention_bench.py --sweep --no-table --models Ouro,Nanbeige \
    --cases 1x128,1x256,1x512,8x128,8x256 --extra "block_n=64;block_n=16" --out "$OUT/sweep_short.md" \
    > "$OUT/sweep_short.log" 2>&1
  grep -E "\| (default|block_n=64|block_n=16) \|" "$OUT/sweep_short.md"
  # session 23 (issue 4): the default prefill buckets' capture time, memory and replays (prompts of 16-2000 tokens)
  timeout 100 python3 benchmarks/prefill_graph_bench.py --model ouro-1.4b --engine-defaults --lengths 16,128,512,1000,2000 \
    --mixed 0 --reps 3 --out "$OUT/prefill_graph_defaults.md" 2>&1 | grep -E "^(\||Prefill|error)"
fi
if [[ $what == pending61 ]]; then
  # prepared in session 17 (issue 3): decode is 0.93-1.00x SDPA, widest at bandwidth-bound MHA (Ouro batch
  # 128 at 8k: 4311 vs 4516 GB/s). How much of that is the paging: shuffled 16-position blocks against
  # blocks in sequence order, and 64-position blocks
  for opts in "" "--ordered-blocks" "--block-size 64" "--block-size 64 --ordered-blocks"; do
    echo "== attention_bench $opts"
    timeout 120 python3 benchmarks/attention_bench.py $opts --cases 32x1024,128x1024,32x8192,128x8192 \
      --out "$OUT/attention_${opts// /_}.md" 2>&1 | grep -E "^(Ouro|Nanbeige) .*\| (32|128) \| (1024|8192) \|"
  done
  # session 18: split_grain balances the splits of a 1k context too (2 splits: 528 + 497 keys, not 576 + 449)
  timeout 150 python3 benchmarks/attention_bench.py --sweep --no-table --models Nanbeige --cases 16x1024,32x1024,32x8192 \
    --extra "split_grain=16" --out "$OUT/sweep_nb_grain.md" > "$OUT/sweep_nb_grain.log" 2>&1
  grep -E "\| (default|split_grain)" "$OUT/sweep_nb_grain.md"
fi
if [[ $what == pending63 ]]; then
  # prepared in session 18 (issue 3): where the TMA prefill's key loop stalls, with and without its softmax
  # options (fold_scale: the scale inside the exponent's FMA; rescale_slack: the running max moves only
  # once a row's max grew past a slack). Their parity and timing are in pending82; this is Nsight Compute
  # on the 1 x 8k kernel (~3 min)
  for cfg in "" fold_scale=1,rescale_slack=8; do
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
  # session 21 (issue 4): prefill graphs for Nanbeige and Huginn, then the engine bench's scenarios (16
  # output tokens) compiled + graphs with and without prefill / mixed-step graphs (~8 min)
  for model in nanbeige4.2-3b huginn-0125; do
    timeout 130 python3 benchmarks/prefill_graph_bench.py --model $model --out "$OUT/prefill_graph_$model.md" 2>&1 \
      | grep -E "^(\||Prefill|error)"
  done
  timeout 250 python3 benchmarks/engine_bench.py --modes no-prefill-graphs,compiled --quick --time-limit 20 \
    --warm-time-limit 5 --out "$OUT/engine_prefill_graphs.md" 2>&1 | grep -E "^(\||\[)"
fi
if [[ $what == pending71 ]]; then
  # session 21 (issue 4 / the engine's self-speculation): draft passes replay decode graphs captured with
  # the draft options, verify passes graphs with a logits row per token (before: both ran the compiled
  # step unreplayed, host-bound). GPU tests, then the engine plain vs speculative at batch 1 and 4 (~5 min)
  timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_engine_speculative.py \
    > "$OUT/gpu_tests.log" 2>&1
  tail -1 "$OUT/gpu_tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head
  timeout 330 python3 benchmarks/spec_bench.py --skip-spec --engine --tokens 128 --out "$OUT/spec_engine.md" 2>&1 \
    | grep -E "^(engine|\|)"
fi
if [[ $what == pending72 ]]; then
  # session 21 (issue 4): TTFT and ITL behind the OpenAI server, compiled + decode graphs, with and without
  # prefill / mixed-step graphs (128-token prompts, 64 output tokens, concurrency 1 and 16) (~5 min)
  for graphs in "--prefill-graphs off" ""; do
    echo "== serve_bench --compile $graphs"
    timeout 150 python3 benchmarks/serve_bench.py --compile $graphs --concurrency 1,16 --time-limit 20 \
      --out "$OUT/serve${graphs:+_no_prefill_graphs}.md" 2>&1 | grep -E "^\|" | tail -4
  done
fi
exit 0
