#!/usr/bin/env bash
# One device call: install the carried wheels, run the GPU tests, then the benchmarks; logs go to $OUT.
# Usage (device tool, carry [".whl"] made by ../shared/tools/device-wheels.sh):
#   bash benchmarks/run_device.sh [tests|bench|more|final|pending1..pending80|all] [extra pytest args]
#   tests: pytest -m gpu; bench: decode / attention / engine; more: depth, speculation+WCPB, engine profile;
#   final: a tree's GPU tests, the four models and the attention table (~6 minutes)
#   pending1 / pending2: what was written but not yet run or timed on a GPU (~8 / ~7 minutes; docs/benchmarks.md)
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
if [[ $what == pending1 ]]; then
  run timeout 200 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_gemv.py tests/test_fuse_rope_gemv.py \
    tests/test_pdl.py tests/test_triton_kernels.py tests/test_graphs_gpu.py tests/test_async_pipeline.py \
    tests/test_engine_wavefront.py tests/test_input_buffers.py
  # the dot-free GEMV at 2-4 rows vs the tl.dot tile vs cuBLAS: sets gemv.OP_MAX_ROWS
  run timeout 60 python3 benchmarks/pipeline_pass_profile.py --model nanbeige4.2-3b --linears-only --rows 1,2,3,4,8
  # Ouro-1.4B decode: default; without the fused split reduce / early metadata reads; with fuse_rope_gemv
  run timeout 120 python3 -m rlt_compile.bench --model ouro-1.4b --eager-steps 1 --compiled-steps 0 --profile \
    --out "$OUT/ouro_default.md"
  run env RLT_ATTENTION_CONFIG=fuse_reduce=0,early_reads=0 timeout 100 python3 -m rlt_compile.bench --model ouro-1.4b \
    --eager-steps 0 --compiled-steps 0 --out "$OUT/ouro_attn_old.md"
  run timeout 100 python3 -m rlt_compile.bench --model ouro-1.4b --eager-steps 0 --compiled-steps 0 \
    --passes attention_swap,dot_precision,fuse_linears,fuse_rmsnorm,gemv_swap,fuse_rope_gemv --out "$OUT/ouro_rope.md"
fi
if [[ $what == pending2 ]]; then
  # issue 10: H2D copies on the side stream vs the compute stream vs UVA (no copy)
  for env in RLT_COPY_STREAM=1 RLT_COPY_STREAM=0 RLT_UVA=1; do
    run env $env timeout 120 python3 -m rlt_compile.bench --engine-profile --model ouro-1.4b --batches 1,32 \
      --out "$OUT/engine_profile_${env}.md"
  done
  run timeout 200 python3 benchmarks/attention_bench.py --sweep --no-table --out "$OUT/attention_sweep.md"
fi
if [[ $what == pending3 ]]; then
  run timeout 150 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_triton_kernels.py tests/test_pdl.py \
    tests/test_fuse_rope_gemv.py tests/test_gemv.py tests/test_graphs_gpu.py
  run timeout 190 python3 benchmarks/attention_bench.py --sweep --no-table --out "$OUT/attention_sweep.md"
  run timeout 120 python3 -m rlt_compile.bench --model ouro-1.4b,nanbeige4.2-3b --eager-steps 1 --compiled-steps 0 \
    --profile --out "$OUT/decode.md"
fi
if [[ $what == pending4 ]]; then
  # the final tree of session 6, end to end: GPU tests of the changed parts, decode, engine profile, attention sweep
  run timeout 120 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_triton_kernels.py tests/test_pdl.py \
    tests/test_fuse_rope_gemv.py tests/test_gemv.py tests/test_graphs_gpu.py
  run timeout 120 python3 -m rlt_compile.bench --model ouro-1.4b,nanbeige4.2-3b --eager-steps 1 --compiled-steps 0 \
    --profile --out "$OUT/decode.md"
  run timeout 110 python3 -m rlt_compile.bench --engine-profile --model ouro-1.4b --batches 1,32 \
    --out "$OUT/engine_profile.md"
  run timeout 180 python3 benchmarks/attention_bench.py --sweep --no-table --out "$OUT/attention_sweep.md"
fi
if [[ $what == pending6 ]]; then
  # session 8: attention GPU tests (the write-kernel rule), decode with the critical-path profile, engine
  # profiles (default passes; + fuse_swiglu_gemv), the attention table of issue 3
  timeout 100 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_triton_kernels.py tests/test_fuse_swiglu_gemv.py \
    tests/test_gemv.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -5
  run timeout 100 python3 -m rlt_compile.bench --model ouro-1.4b,nanbeige4.2-3b --eager-steps 1 --compiled-steps 0 \
    --profile --out "$OUT/decode.md"
  run timeout 80 python3 -m rlt_compile.bench --engine-profile --model ouro-1.4b --batches 1,32,128 \
    --out "$OUT/engine_profile.md"
  run timeout 80 python3 -m rlt_compile.bench --engine-profile --model ouro-1.4b --batches 1,32,128 \
    --passes attention_swap,dot_precision,fuse_linears,fuse_rmsnorm,gemv_swap,fuse_rope_gemv,fuse_swiglu_gemv \
    --out "$OUT/engine_profile_swiglu.md"
  run timeout 150 python3 benchmarks/attention_bench.py --out "$OUT/attention.md"
fi
if [[ $what == pending7 ]]; then
  # session 8, final tree: fuse_swiglu_gemv default, norm weights and the first cached K/V tile read
  # before the PDL wait; A/B of the K/V tile (early_kv=0), engine profiles, GPU tests of the changed parts.
  # Ran at commit cde7dce: the early K/V tile was then reverted, so RLT_ATTENTION_CONFIG=early_kv=0 is
  # rejected as an unknown key on later trees.
  timeout 120 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_triton_kernels.py tests/test_pdl.py \
    tests/test_fuse_rmsnorm.py tests/test_fuse_swiglu_gemv.py tests/test_graphs_gpu.py tests/test_gemv.py \
    2>&1 | tee "$OUT/gpu_tests.log" | tail -5
  run timeout 110 python3 -m rlt_compile.bench --model ouro-1.4b,nanbeige4.2-3b,huginn-0125 --eager-steps 1 \
    --compiled-steps 0 --profile --out "$OUT/decode.md"
  run env RLT_ATTENTION_CONFIG=early_kv=0 timeout 70 python3 -m rlt_compile.bench --model ouro-1.4b,nanbeige4.2-3b \
    --eager-steps 0 --compiled-steps 0 --out "$OUT/decode_late_kv.md"
  run timeout 80 python3 -m rlt_compile.bench --engine-profile --model ouro-1.4b --batches 1,32,128 \
    --out "$OUT/engine_profile.md"
  run timeout 60 python3 benchmarks/attention_bench.py --out "$OUT/attention.md"
fi
if [[ $what == pending8 ]]; then
  # session 8: decode attention's split/tile choice at batch 1 end to end (Ouro-1.4B, context 128)
  timeout 60 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_triton_kernels.py -k decode \
    2>&1 | tee "$OUT/gpu_tests.log" | tail -3
  for cfg in "" splits=1 splits=2 block_n=128; do
    run env RLT_ATTENTION_CONFIG=$cfg timeout 60 python3 -m rlt_compile.bench --model ouro-1.4b --eager-steps 0 \
      --compiled-steps 0 --out "$OUT/ouro_attn_$(echo "${cfg:-default}" | tr '=,' '__').md"
  done
fi
if [[ $what == pending9 ]]; then
  # session 9: L2 prefetch of later weights by the decode GEMVs (prefetch_weights pass; needs commit 0becb8d,
  # since reverted: slower, docs/benchmarks.md)
  timeout 150 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_prefetch_weights.py tests/test_gemv.py \
    tests/test_fuse_swiglu_gemv.py tests/test_fuse_rope_gemv.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -5
  run timeout 150 python3 benchmarks/gemv_chain_bench.py --grid "" --l2-lookahead 8,16,32 --pf-programs 4,16 \
    --out "$OUT/chain_l2.md"
  all=attention_swap,dot_precision,fuse_linears,fuse_rmsnorm,gemv_swap,fuse_rope_gemv,fuse_swiglu_gemv,prefetch_weights
  run timeout 80 python3 -m rlt_compile.bench --model ouro-1.4b --eager-steps 0 --compiled-steps 0 --out "$OUT/ouro_default.md"
  for mb in 16 32; do
    run env RLT_L2_PREFETCH_MB=$mb timeout 80 python3 -m rlt_compile.bench --model ouro-1.4b --eager-steps 0 \
      --compiled-steps 0 --passes $all --out "$OUT/ouro_l2_$mb.md"
  done
  run env RLT_L2_PREFETCH_MB=32 RLT_GEMV_CONFIG=evict_first=1 timeout 80 python3 -m rlt_compile.bench --model ouro-1.4b \
    --eager-steps 0 --compiled-steps 0 --passes $all --out "$OUT/ouro_l2_32_evict.md"
fi
if [[ $what == pending10 ]]; then
  # session 9: per-line L2 prefetch from every program (pf_programs=0; needs commit f6cb412, since reverted),
  # then the one-row GEMV tile grid
  timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_prefetch_weights.py 2>&1 | tail -3
  run timeout 150 python3 benchmarks/gemv_chain_bench.py --grid "" --l2-lookahead 2,4,8,16 --pf-programs 0,64 \
    --out "$OUT/chain_l2_lines.md"
  run timeout 200 python3 benchmarks/gemv_chain_bench.py --grid 1,2:1024,2048:4,8:3,4 --out "$OUT/chain_grid.md"
fi
if [[ $what == pending11 ]]; then
  # session 9: prefill through FlashAttention-2 varlen + the paged kernel's prefix merge (flash_varlen; needs
  # commit d98e085, since removed: slower, docs/benchmarks.md); on later trees: GPU tests + the attention table
  timeout 240 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_triton_kernels.py tests/test_engine_gpu.py \
    tests/test_graphs_gpu.py tests/test_async_pipeline.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -8
  run timeout 200 python3 benchmarks/attention_bench.py --out "$OUT/attention.md"
fi
if [[ $what == pending12 ]]; then
  # session 9: the prefill split path with FlashAttention-2 or cuDNN (config flash_prefill=1 / 2; needs commit
  # 867a948, since removed), vs SDPA's backends
  timeout 120 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_triton_kernels.py -k flash \
    2>&1 | tee "$OUT/gpu_tests.log" | tail -8
  run timeout 200 python3 benchmarks/attention_bench.py --out "$OUT/attention.md"
fi
if [[ $what == pending13 ]]; then
  # session 9: pending12 with the cuDNN split path timed eagerly (its varlen call fails under graph capture;
  # needs commit 086a900)
  run timeout 200 python3 benchmarks/attention_bench.py --out "$OUT/attention.md"
fi
# pending14..pending19 (session 10: the one-launch decode layer, removed) need commit bf9fb2f.
if [[ $what == pending20 ]]; then
  # session 10: per-shape tiles for the o and down GEMVs on the decode chain
  run timeout 110 python3 benchmarks/gemv_chain_bench.py --shape-sweep --reps 20 --out "$OUT/shape_sweep.md"
fi
# pending21 / pending22 (session 11: the norm folded into the next GEMV, merge in one trip) need commits
# 9b6f60e / e7cf4e0: both were removed as no faster (docs/benchmarks.md, session 11).
if [[ $what == pending23 ]]; then
  # session 11: where the device idles in an engine decode step (issue 10); rerun after the profiled run stopped draining the pipeline first
  run timeout 400 python3 -m rlt_compile.bench --engine-profile --model ouro-1.4b --batches 1,32,128 \
    --out "$OUT/engine_profile.md"
  RLT_COPY_STREAM=0 run timeout 150 python3 -m rlt_compile.bench --engine-profile --model ouro-1.4b --batches 1 \
    --out "$OUT/engine_profile_copy0.md"
  RLT_UVA=1 run timeout 150 python3 -m rlt_compile.bench --engine-profile --model ouro-1.4b --batches 1 \
    --out "$OUT/engine_profile_uva.md"
fi
if [[ $what == pending24 ]]; then
  # session 11: the async engine's GPU tests on the final tree, and the batch-1 engine profile again (issue 10)
  run timeout 300 python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/test_async_engine.py \
    tests/test_async_pipeline.py tests/test_input_buffers.py tests/test_engine_gpu.py
  run timeout 150 python3 -m rlt_compile.bench --engine-profile --model ouro-1.4b --batches 1 \
    --out "$OUT/engine_profile_b1.md"
fi
if [[ $what == pending25 ]]; then
  # session 11: all four models on the final tree (issue 4's table: eager, compiled, graphs, compile time)
  run timeout 560 python3 -m rlt_compile.bench --model all --eager-steps 2 --compiled-steps 8 --out "$OUT/decode_all.md"
fi
if [[ $what == pending26 ]]; then
  # session 11: GQA's split-K merged in the decode kernel, the group's heads at once (issue 3)
  run timeout 170 python3 benchmarks/attention_bench.py --sweep --no-table --models Nanbeige --out "$OUT/attention_sweep.md"
  run timeout 90 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_triton_kernels.py -k decode_kernel_parity
  RLT_ATTENTION_CONFIG=fuse_reduce=1 run timeout 70 python3 -m rlt_compile.bench --model nanbeige4.2-3b \
    --eager-steps 0 --compiled-steps 0 --out "$OUT/nb_fused.md"
fi
# pending27 (session 12: the norms accumulated inside the next GEMV, kernels/norm_gemv.py) needs commit f486b60:
# it was removed as slower (docs/benchmarks.md, session 12).
if [[ $what == pending28 ]]; then
  # session 12: fresh causal prefill through TMA descriptors on the step's contiguous q/k/v (issue 3 probe);
  # GQA decode with one stage (issue 3: Nanbeige batch 32 at 1k)
  run timeout 240 python3 benchmarks/fresh_prefill_probe.py --out "$OUT/fresh_prefill_probe.md"
  run timeout 240 python3 benchmarks/attention_bench.py --sweep --no-table --models Nanbeige --out "$OUT/attention_sweep.md"
fi
if [[ $what == pending29 ]]; then
  # session 12: prefill attention with the step's own keys through TMA (kernels/prefill_tma.py, issue 3)
  run timeout 240 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_prefill_tma.py \
    tests/test_triton_kernels.py tests/test_graphs_gpu.py tests/test_pdl.py
  run timeout 200 python3 benchmarks/prefill_tma_bench.py --out "$OUT/prefill_tma.md"
  run timeout 150 python3 benchmarks/attention_bench.py --out "$OUT/attention.md"
fi
if [[ $what == pending30 ]]; then
  # session 13: the KV write inside the TMA prefill kernel (issue 3); Ouro-1.4B's whole critical path (issue 4)
  run timeout 240 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_prefill_tma.py \
    tests/test_triton_kernels.py tests/test_graphs_gpu.py tests/test_pdl.py tests/test_engine_gpu.py
  run timeout 200 python3 benchmarks/prefill_tma_bench.py --out "$OUT/prefill_tma.md"
  python3 -m rlt_compile.bench --model ouro-1.4b --eager-steps 0 --compiled-steps 0 --profile --profile-top 60 \
    --out "$OUT/ouro_profile.md" > "$OUT/ouro_profile.log" 2>&1; tail -5 "$OUT/ouro_profile.log"
fi
if [[ $what == pending31 ]]; then
  # session 13: PDL kernels triggering their dependents before their own wait (RLT_PDL_TRIGGER=early, issue 4)
  run timeout 200 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_pdl.py tests/test_gemv.py \
    tests/test_fuse_rope_gemv.py
  run env RLT_PDL_TRIGGER=early timeout 200 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_graphs_gpu.py \
    tests/test_engine_gpu.py tests/test_gemv.py tests/test_triton_kernels.py tests/test_prefill_tma.py
  for trig in wait early wait early; do
    run env RLT_PDL_TRIGGER=$trig timeout 100 python3 -m rlt_compile.bench --model ouro-1.4b,nanbeige4.2-3b \
      --eager-steps 0 --compiled-steps 0 --out "$OUT/decode_$trig.md"
  done
  run env RLT_PDL_TRIGGER=early timeout 100 python3 -m rlt_compile.bench --model ouro-1.4b --eager-steps 1 \
    --compiled-steps 0 --profile --out "$OUT/ouro_early_profile.md"
fi
if [[ $what == pending32 ]]; then
  # session 13: with the early PDL trigger (now the default): GEMV tiles on the chain, attention splits, all models
  run timeout 120 python3 benchmarks/gemv_chain_bench.py --grid 2:1024,2048:4:3 --reps 20 --out "$OUT/chain_grid.md"
  run env RLT_PDL_TRIGGER=wait timeout 90 python3 benchmarks/gemv_chain_bench.py --grid 2:1024:4:3 --reps 20 \
    --out "$OUT/chain_wait.md"
  run timeout 150 python3 benchmarks/gemv_chain_bench.py --shape-sweep --reps 20 --out "$OUT/chain_shapes.md"
  for cfg in splits=8 block_n=32 splits=2; do
    run env RLT_ATTENTION_CONFIG=$cfg timeout 80 python3 -m rlt_compile.bench --model ouro-1.4b --eager-steps 0 \
      --compiled-steps 0 --out "$OUT/ouro_$cfg.md"
  done
  run timeout 200 python3 -m rlt_compile.bench --model all --eager-steps 1 --compiled-steps 0 --out "$OUT/decode_all.md"
fi
if [[ $what == pending33 ]]; then
  # session 13: 2048-long GEMV runs for weight rows of 4096+ (issue 4); the final tree's GPU tests and four models
  run timeout 240 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_gemv.py tests/test_pdl.py \
    tests/test_fuse_rope_gemv.py tests/test_fuse_swiglu_gemv.py tests/test_graphs_gpu.py tests/test_compiler.py \
    tests/test_async_engine.py tests/test_prefill_tma.py
  run timeout 200 python3 -m rlt_compile.bench --model all --eager-steps 1 --compiled-steps 0 --out "$OUT/decode_all.md"
  python3 -m rlt_compile.bench --model ouro-1.4b --eager-steps 0 --compiled-steps 0 --profile --out "$OUT/ouro_profile.md" \
    > "$OUT/ouro_profile.log" 2>&1; tail -3 "$OUT/ouro_profile.log"
fi
if [[ $what == pending34 ]]; then
  # session 13: which weight rows take 2048-long GEMV runs (issue 4): k >= 4096 (A), 4096 <= k <= 8192 (B), never (C)
  for rule in B C A; do
    run timeout 150 python3 - "$rule" "$OUT" <<'PY'
import sys
from rlt_compile import bench
from rlt_compile.kernels import gemv
rule, out = sys.argv[1], sys.argv[2]
plain = gemv.gemv_config
def patched(m, n, k, dtype, device, silu_mul=False):
    cfg = plain(m, n, k, dtype, device, silu_mul)
    if cfg["block_k"] == 2048 and not cfg["dot"] and (rule == "C" or (rule == "B" and k > 8192)):
        cfg["block_k"] = 1024
    return cfg
gemv.gemv_config = patched
models = "nanbeige4.2-3b,huginn-0125" if rule != "A" else "nanbeige4.2-3b"
bench.main(["--model", models, "--eager-steps", "0", "--compiled-steps", "0", "--out", f"{out}/rule_{rule}.md"])
PY
  done
fi
if [[ $what == pending35 ]]; then
  # session 13: 2048-long GEMV runs unless they split a one-wave grid (issue 4): GPU tests, four models
  run timeout 150 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_gemv.py tests/test_fuse_swiglu_gemv.py \
    tests/test_fuse_rope_gemv.py tests/test_graphs_gpu.py
  run timeout 200 python3 -m rlt_compile.bench --model all --eager-steps 1 --compiled-steps 0 --out "$OUT/decode_all.md"
fi
if [[ $what == pending36 ]]; then
  # session 14: what the attention and the norms could win at most on the decode chain, attention
  # launcher variants, one GEMV's tiles at a time (issue 4); MHA decode with the tl.dot tile (issue 3)
  run timeout 200 python3 benchmarks/gemv_chain_bench.py --variants --reps 20 --out "$OUT/chain_variants.md"
  run timeout 200 python3 benchmarks/gemv_chain_bench.py --shape-sweep --reps 20 --out "$OUT/chain_shapes.md"
  run timeout 150 python3 benchmarks/attention_bench.py --sweep --no-table --models Ouro --out "$OUT/attention_sweep.md"
fi
if [[ $what == pending37 ]]; then
  # session 14: the decode attention's first K/V tile prefetched into L2 before its PDL wait, with
  # warps / tl.dot combinations, on the chain and end to end (issue 4)
  run timeout 150 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_pdl.py tests/test_triton_kernels.py \
    -k "decode or pdl"
  run timeout 200 python3 benchmarks/gemv_chain_bench.py --variants --reps 20 --only "swiglu epilogue,bound" \
    --out "$OUT/chain_variants.md"
  for cfg in "" warps=8 l2_prefetch=1 l2_prefetch=1,warps=8 ""; do
    run env RLT_ATTENTION_CONFIG=$cfg timeout 100 python3 -m rlt_compile.bench --model ouro-1.4b --eager-steps 0 \
      --compiled-steps 0
  done
fi
if [[ $what == pending38 ]]; then
  # session 14: the L2 prefetch of a split's whole range, fewer splits (issue 4); GPU parity first
  run timeout 150 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_pdl.py tests/test_triton_kernels.py \
    -k "decode or pdl"
  run timeout 200 python3 benchmarks/gemv_chain_bench.py --variants --reps 20 --only "swiglu epilogue,bound" \
    --out "$OUT/chain_variants.md"
  for cfg in "" l2_prefetch=1 splits=1,l2_prefetch=4,warps=8 splits=2,l2_prefetch=2 ""; do
    echo "== RLT_ATTENTION_CONFIG=$cfg"
    RLT_ATTENTION_CONFIG=$cfg timeout 100 python3 -m rlt_compile.bench --model ouro-1.4b --eager-steps 0 \
      --compiled-steps 0 2>&1 | grep "graphs .* ms/token"
  done
  for cfg in "" l2_prefetch=1 ""; do
    echo "== Nanbeige RLT_ATTENTION_CONFIG=$cfg"
    RLT_ATTENTION_CONFIG=$cfg timeout 100 python3 -m rlt_compile.bench --model nanbeige4.2-3b --eager-steps 0 \
      --compiled-steps 0 2>&1 | grep "graphs .* ms/token"
  done
fi
if [[ $what == final || $what == pending39 || $what == pending47 || $what == pending59 ]]; then
  # a session's final tree (session 14: pending39, session 15: pending47, session 17: pending59): GPU tests
  # (logs in $OUT), then the four models and the attention table (issues 3, 4)
  timeout 240 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_pdl.py tests/test_triton_kernels.py \
    tests/test_graphs_gpu.py tests/test_engine_gpu.py tests/test_prefill_tma.py tests/test_gemv.py tests/test_fuse_rmsnorm.py \
    tests/test_fuse_rope_gemv.py > "$OUT/gpu_tests.log" 2>&1
  tail -2 "$OUT/gpu_tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -20
  run timeout 240 python3 -m rlt_compile.bench --model all --eager-steps 1 --compiled-steps 0 --out "$OUT/decode_all.md"
  run timeout 150 python3 benchmarks/attention_bench.py --out "$OUT/attention.md"
fi
if [[ $what == pending40 ]]; then
  # session 14: 16-bit MHA decode takes the tl.dot tile where the context is split (issue 3/4)
  timeout 150 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_triton_kernels.py tests/test_graphs_gpu.py \
    -k "decode or graph" > "$OUT/gpu_tests.log" 2>&1
  tail -2 "$OUT/gpu_tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -20
  timeout 60 python3 -m rlt_compile.bench --model ouro-1.4b --eager-steps 0 --compiled-steps 0 2>&1 | grep "graphs .* ms/token"
fi
if [[ $what == pending41 ]]; then
  # session 15: decode split-K merge over the splits that have keys, lse and partials loaded at once:
  # GPU parity, then Ouro-1.4B end to end against the previous tree (.carry/old, carried) alternating
  timeout 200 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_triton_kernels.py tests/test_pdl.py \
    tests/test_graphs_gpu.py -k "decode or pdl or graph" > "$OUT/gpu_tests.log" 2>&1
  tail -2 "$OUT/gpu_tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -20
  for tree in old new old new; do
    dir=$PWD; [[ $tree == old ]] && dir=$PWD/.carry/old
    echo "== $tree"
    (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout 100 python3 -m rlt_compile.bench --model ouro-1.4b \
      --eager-steps 0 --compiled-steps 0 2>&1 | grep "graphs .* ms/token")
  done
  for tree in old new; do
    dir=$PWD; [[ $tree == old ]] && dir=$PWD/.carry/old
    echo "== chain $tree"
    (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout 100 python3 benchmarks/gemv_chain_bench.py --variants \
      --reps 20 --only "swiglu epilogue" 2>&1 | tail -4)
  done
fi
if [[ $what == pending42 ]]; then
  # session 15: the KV cache stored head-major ([2, blocks, Hkv, bs, D] under the same view): attention
  # table with each layout, then the Nanbeige decode sweep head-major (issue 3)
  run timeout 170 python3 benchmarks/attention_bench.py --out "$OUT/attention.md"
  run timeout 170 python3 benchmarks/attention_bench.py --head-major --out "$OUT/attention_head_major.md"
  run timeout 150 python3 benchmarks/attention_bench.py --head-major --sweep --no-table --models Nanbeige \
    --out "$OUT/sweep_head_major.md"
fi
if [[ $what == pending43 ]]; then
  # session 15: Triton's automatic warp specialization of the TMA prefill kernel's key loop (issue 3);
  # slower, removed: --warp-specialize exists at commit ba6f2cb
  run timeout 200 python3 benchmarks/prefill_tma_bench.py --warp-specialize --out "$OUT/prefill_ws.md"
fi
if [[ $what == pending44 ]]; then
  # session 15: Nsight Compute on the decode kernel: Nanbeige batch 32 at 1k (63% of copy bandwidth) with
  # the reduce kernel and with the fused merge, Ouro batch 1 at 128 (the decode chain's shape) (issue 3/4)
  prof() { local tag=$1; shift; timeout 150 ncu --kernel-name regex:_paged_attention_decode_kernel --launch-skip 2 \
    --launch-count 1 --set full python3 benchmarks/attention_case.py "$@" > "$OUT/ncu_$tag.txt" 2>&1
    echo "== $tag rc=$?"; grep -E "Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Waves Per SM" "$OUT/ncu_$tag.txt" | head -12; }
  prof nanbeige_b32_1k --model Nanbeige --batch 32 --ctx 1024
  RLT_ATTENTION_CONFIG=fuse_reduce=1 prof nanbeige_b32_1k_fused --model Nanbeige --batch 32 --ctx 1024
  prof ouro_b1_128 --model Ouro --batch 1 --ctx 129
fi
if [[ $what == pending45 ]]; then
  # session 15: GQA decode held to 4 programs per SM by 128 registers (ncu, pending44): register caps,
  # alone and with one stage / more splits (issue 3); slower, removed: the maxnreg key exists at commit ba6f2cb
  run timeout 250 python3 benchmarks/attention_bench.py --sweep --no-table --models Nanbeige \
    --cases 1x1024,32x1024,128x1024,32x8192,32x128 --extra "maxnreg=96;maxnreg=80;maxnreg=64;stages=1,maxnreg=80;\
stages=1,maxnreg=64;splits=4,maxnreg=80;splits=4,stages=1,maxnreg=64;fuse_reduce=1,maxnreg=80;block_n=32,maxnreg=64;\
fuse_reduce=1,stages=1,maxnreg=64" --out "$OUT/sweep_maxnreg.md"
fi
if [[ $what == pending46 ]]; then
  # session 15: Nsight Compute on each batch-1 decode GEMV alone (Ouro-1.4B, Nanbeige), clocks unlocked (issue 4)
  for model in ouro-1.4b nanbeige4.2-3b; do
    timeout 200 ncu --clock-control none --kernel-name regex:gemv --launch-skip 4 --launch-count 4 \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
      --section MemoryWorkloadAnalysis --section SchedulerStats python3 benchmarks/gemv_case.py --model $model \
      > "$OUT/ncu_gemv_$model.txt" 2>&1
    echo "== $model rc=$?"
    grep -E "Grid Size|Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Waves Per SM" "$OUT/ncu_gemv_$model.txt"
  done
fi
if [[ $what == pending48 ]]; then
  # session 15: the merge over the splits with keys where most splits are empty: the decode chain at
  # context 128 with a 4096-position block table (32 splits at batch 1), previous tree (.carry/old) first
  for tree in old new old new; do
    dir=$PWD; [[ $tree == old ]] && dir=$PWD/.carry/old
    echo "== chain $tree"
    (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout 70 python3 benchmarks/gemv_chain_bench.py --variants \
      --reps 20 --table 4096 --only "swiglu epilogue" 2>&1 | grep -E "^\| swiglu epilogue \|")
  done
fi
if [[ $what == pending49 ]]; then
  # session 15: Ouro-1.4B end to end with a 4096-position block table (as an engine's, 32 splits at batch 1):
  # the previous tree (.carry/old, with the same --table option) alternating with this one
  for tree in old new old new; do
    dir=$PWD; [[ $tree == old ]] && dir=$PWD/.carry/old
    echo "== $tree"
    (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout 60 python3 -m rlt_compile.bench --model ouro-1.4b --table 4096 \
      --eager-steps 0 --compiled-steps 0 2>&1 | grep "graphs .* ms/token")
  done
fi
if [[ $what == pending50 ]]; then
  # next: why 32 splits (29 empty) beat 4 at context 128: the chain at the bench's short table with forced
  # split counts, then Ouro-1.4B end to end with splits=32 forced and with the decode kernel's PDL trigger
  # after its wait (late_trigger=1: the o GEMV launches once the q/k/v GEMV is done), alternating (issue 4)
  run timeout 200 python3 benchmarks/gemv_chain_bench.py --variants --reps 20 --only "swiglu epilogue,splits=,late_trigger" \
    --out "$OUT/chain_splits.md"
  for cfg in "" splits=32 late_trigger=1 "" splits=32 late_trigger=1; do
    echo "== RLT_ATTENTION_CONFIG=$cfg"
    RLT_ATTENTION_CONFIG=$cfg timeout 60 python3 -m rlt_compile.bench --model ouro-1.4b --eager-steps 0 \
      --compiled-steps 0 2>&1 | grep "graphs .* ms/token"
  done
  # the block table read two tiles ahead (prefetch=2, issue 3), Nanbeige decode, GPU parity first
  timeout 150 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_triton_kernels.py -k "decode" \
    > "$OUT/gpu_tests.log" 2>&1
  tail -2 "$OUT/gpu_tests.log"
  run timeout 200 python3 benchmarks/attention_bench.py --sweep --no-table --models Nanbeige \
    --cases 1x1024,32x1024,128x1024,32x8192,1x8192 --extra "prefetch=2;prefetch=2,stages=3;prefetch=2,block_n=32" \
    --out "$OUT/sweep_prefetch2.md"
fi
if [[ $what == pending51 ]]; then
  # next: the decode split count at the bench's short block table (4 for batch 1) against the count an
  # engine-sized table gives (the waves target: 32 for Ouro's 16 heads, 64 for Nanbeige's 8 KV heads), end to
  # end, alternating (issues 3, 4)
  bench_cfg() {  # model, configs...
    local model=$1; shift
    for cfg in "$@"; do
      echo "== $model RLT_ATTENTION_CONFIG=$cfg"
      RLT_ATTENTION_CONFIG=$cfg timeout 70 python3 -m rlt_compile.bench --model "$model" --eager-steps 0 \
        --compiled-steps 0 2>&1 | grep "graphs .* ms/token"
    done
  }
  bench_cfg ouro-1.4b "" splits=8 splits=16 splits=32 splits=64 ""
  bench_cfg nanbeige4.2-3b "" splits=16 splits=64 ""
  bench_cfg ouro-2.6b "" splits=32
fi
if [[ $what == pending52 ]]; then
  # next: the GEMV-only decode chain as one persistent kernel with grid barriers (what a megakernel could
  # win, issue 4), then Huginn-0125 (55 heads) at 8 decode splits (the new MHA rule) against the 4 the
  # short table allowed before, alternating
  run timeout 150 python3 benchmarks/persistent_chain_bench.py --reps 10 --out "$OUT/persistent_chain.md"  # at 34ae338
  for cfg in "" splits=4 ""; do
    echo "== huginn-0125 RLT_ATTENTION_CONFIG=$cfg"
    RLT_ATTENTION_CONFIG=$cfg timeout 80 python3 -m rlt_compile.bench --model huginn-0125 --eager-steps 0 \
      --compiled-steps 0 2>&1 | grep "graphs .* ms/token"
  done
fi
if [[ $what == pending53 ]]; then
  # (at d1b40b3, removed after) the norms run by the o / down GEMV's last program (linear_add_rmsnorm2_gemv: no norm kernel, no kernel
  # boundary), GPU parity first, then the decode chain against the norm kernels, twice (issue 4)
  timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gemv.py -k "norm_tail" 2>&1 | tail -3
  run timeout 150 python3 benchmarks/gemv_chain_bench.py --variants --reps 20 --only "swiglu epilogue,norm tail,no norm" \
    --out "$OUT/chain_tail.md"
  run timeout 80 python3 benchmarks/gemv_chain_bench.py --variants --reps 20 --only "norm tail,gemv default" \
    --out "$OUT/chain_tail2.md"
fi
if [[ $what == pending54 ]]; then
  # GQA decode with smaller key tiles and deeper cp.async pipelines (issue 3: Nanbeige batch 32 at 1k, 62% of
  # copy bandwidth; sm_90 offline: 64-key tiles 122 registers -> 4 programs/SM, 32-key 88 -> 5, 16-key 84 -> 6)
  run timeout 200 python3 benchmarks/attention_bench.py --sweep --no-table --models Nanbeige --cases 1x1024,32x1024,128x1024 \
    --extra "block_n=32,stages=3;block_n=32,stages=4;block_n=16,stages=4;block_n=16,stages=6;block_n=32,stages=4,fuse_reduce=1;block_n=32,stages=4,splits=4" \
    --out "$OUT/sweep_pipeline.md"
fi
if [[ $what == pending55 ]]; then
  # next (prepared in session 16): (a) where the GQA decode kernel stalls, per SASS instruction (Nanbeige batch 32
  # at 1k, 62% of copy bandwidth; issue 3); (b) what 32 mostly-empty decode splits change against 4 in Ouro-1.4B's
  # token (the critical-path shares of --profile; issue 4). First the GPU tests: session 16 moved the launch
  # helpers and launch configuration out of triton_attention.py after its last GPU run
  timeout 240 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_pdl.py tests/test_triton_kernels.py \
    tests/test_graphs_gpu.py tests/test_engine_gpu.py tests/test_prefill_tma.py tests/test_gemv.py > "$OUT/gpu_tests.log" 2>&1
  tail -2 "$OUT/gpu_tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -20
  timeout 200 ncu --kernel-name regex:_paged_attention_decode_kernel --launch-skip 2 --launch-count 1 --set full \
    --import-source yes -o "$OUT/nb32" python3 benchmarks/attention_case.py --model Nanbeige --batch 32 --ctx 1024 \
    > "$OUT/ncu_nb32.txt" 2>&1; echo "== ncu rc=$?"
  ncu --import "$OUT/nb32.ncu-rep" --page source --csv --print-source sass > "$OUT/nb32_sass.csv" 2>&1
  echo "== sass rows $(wc -l < "$OUT/nb32_sass.csv")"; head -3 "$OUT/nb32_sass.csv" | cut -c1-400
  for cfg in "" splits=4; do
    echo "== ouro-1.4b RLT_ATTENTION_CONFIG=$cfg"
    RLT_ATTENTION_CONFIG=$cfg timeout 100 python3 -m rlt_compile.bench --model ouro-1.4b --eager-steps 0 \
      --compiled-steps 0 --profile --profile-top 30 --out "$OUT/ouro_profile_${cfg:-default}.md" 2>&1 | tail -45
  done
fi
if [[ $what == pending56 ]]; then
  # session 17 (issue 3): does the graph timer's memset flush (128 MiB of dirty L2 lines the timed replay
  # writes back) make short decode calls look slower than they are? A one-element op under each flush,
  # then the attention table and Nanbeige's decode sweep under both
  for flush in write read; do
    python3 - "$flush" <<'PY'
import sys, torch
sys.path.insert(0, "benchmarks")
import attention_bench as ab
ab.FLUSH = sys.argv[1]
x = torch.zeros(1, device="cuda")
print(f"== null op, flush {ab.FLUSH}: {ab.bench(lambda: x.add_(1), x.device) * 1e3:.1f} us")
PY
  done
  for flush in read write; do
    run timeout 150 python3 benchmarks/attention_bench.py --flush $flush --out "$OUT/attention_$flush.md"
  done
  run timeout 200 python3 benchmarks/attention_bench.py --flush read --sweep --no-table --models Nanbeige \
    --cases 1x128,1x1024,32x1024,32x8192,128x1024 --out "$OUT/sweep_nb_read.md"
fi
if [[ $what == pending57 ]]; then
  # session 17 (issue 3): GQA decode merging its splits in the kernel where the unsplit grid fills the
  # GPU; the attention table with the read flush twice (run-to-run spread), Nanbeige's decode sweep
  timeout 240 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_triton_kernels.py tests/test_pdl.py \
    tests/test_graphs_gpu.py tests/test_engine_gpu.py > "$OUT/gpu_tests.log" 2>&1
  tail -2 "$OUT/gpu_tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -20
  for i in 1 2; do
    timeout 150 python3 benchmarks/attention_bench.py --out "$OUT/attention_$i.md" > "$OUT/attention_$i.log" 2>&1
    grep -A16 "^## Decode" "$OUT/attention_$i.md" | grep "^| [ON]"
  done
  timeout 200 python3 benchmarks/attention_bench.py --sweep --no-table --models Nanbeige \
    --cases 16x1024,32x1024,32x8192,128x1024 --out "$OUT/sweep_nb.md" > "$OUT/sweep_nb.log" 2>&1
  grep -B2 -A8 "^| model | batch | context | default" "$OUT/sweep_nb.md"
fi
if [[ $what == pending58 ]]; then
  # session 17 (issue 3): GQA's fused split merge from half a wave of unsplit programs (at most 4 splits);
  # the sweep around it (batch 4-64), then the GPU decode tests
  timeout 240 python3 benchmarks/attention_bench.py --sweep --no-table --models Nanbeige \
    --cases 4x1024,8x1024,16x1024,16x8192,64x1024 --out "$OUT/sweep_nb.md" > "$OUT/sweep_nb.log" 2>&1
  grep -A9 "^| model | batch | context | default" "$OUT/sweep_nb.md"
  grep "| default |\|fused merge\|reduce kernel" "$OUT/sweep_nb.md"
  timeout 200 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_triton_kernels.py tests/test_engine_gpu.py \
    > "$OUT/gpu_tests.log" 2>&1
  tail -2 "$OUT/gpu_tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -20
fi
if [[ $what == pending59 ]]; then
  # session 17 (issue 4): with 32 decode splits at batch 1, do smaller key tiles put more of them to work?
  for cfg in block_n=32 block_n=16 ""; do
    echo "== ouro-1.4b RLT_ATTENTION_CONFIG=$cfg"
    RLT_ATTENTION_CONFIG=$cfg timeout 100 python3 -m rlt_compile.bench --model ouro-1.4b --eager-steps 0 \
      --compiled-steps 0 2>&1 | grep "graphs .* ms/token"
  done
fi
if [[ $what == pending60 ]]; then
  # prepared in session 17 (issue 4): 16-key decode tiles made Ouro-1.4B's batch-1 token 2.5% faster at
  # context 128 (3.754-3.759 vs 3.853-3.854 ms; Nanbeige's batch-1 decode call 9.9 vs 10.9 us at 128).
  # Before they become the default: all four models at 128, and at 4096 (one captured graph serves every
  # context of its bucket), then Ouro's batch-1 decode sweep (~7 minutes)
  for cfg in "" block_n=16; do
    echo "== context 128 RLT_ATTENTION_CONFIG=$cfg"
    RLT_ATTENTION_CONFIG=$cfg timeout 150 python3 -m rlt_compile.bench --model all --eager-steps 0 \
      --compiled-steps 0 2>&1 | grep "graphs .* ms/token"
  done
  for cfg in "" block_n=16 block_n=32; do
    echo "== context 4096 RLT_ATTENTION_CONFIG=$cfg"
    RLT_ATTENTION_CONFIG=$cfg timeout 100 python3 -m rlt_compile.bench --model ouro-1.4b,nanbeige4.2-3b \
      --context 4096 --eager-steps 0 --compiled-steps 0 2>&1 | grep "graphs .* ms/token"
  done
  timeout 150 python3 benchmarks/attention_bench.py --sweep --no-table --models Ouro --cases 1x128,1x1024,1x8192 \
    --extra "block_n=16;block_n=16,use_dot=0" --out "$OUT/sweep_ouro_b1.md" > "$OUT/sweep_ouro_b1.log" 2>&1
  grep -E "\| (default|block_n=16|block_n=32)" "$OUT/sweep_ouro_b1.md"
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
if [[ $what == pending62 ]]; then
  # prepared in session 17 (issue 4): why 32 mostly-empty decode splits beat 4 (session 16). early_exit=1
  # lets the empty ones return before the PDL wait instead of after it: if waiting programs are what
  # helps, it is slower; if they cost slots, faster. Session 21: the bench's shape now takes 16-key tiles
  # (9 of the 32 splits have keys at 129 positions), so also 16 and 64 splits. GPU parity first (~4 min)
  timeout 120 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_triton_kernels.py -k "decode_kernel_parity" \
    > "$OUT/gpu_tests.log" 2>&1
  tail -1 "$OUT/gpu_tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head
  for cfg in "" early_exit=1 splits=16 splits=64 block_n=64 block_n=64,early_exit=1 "" early_exit=1; do
    echo "== ouro-1.4b RLT_ATTENTION_CONFIG=$cfg"
    RLT_ATTENTION_CONFIG=$cfg timeout 60 python3 -m rlt_compile.bench --model ouro-1.4b --eager-steps 0 \
      --compiled-steps 0 2>&1 | grep "graphs .* ms/token"
  done
fi
if [[ $what == pending63 ]]; then
  # prepared in session 18 (issue 3): the TMA prefill's key tile with the softmax scale folded into the
  # exponent's FMA (fold_scale) and the running max moved only once a row's max grew past a slack
  # (rescale_slack: most tiles then skip rescaling acc). Offline sm_90 SASS: 96 fewer instructions
  # (fold), the rescale branch-guarded (slack). GPU parity first, then the op, then where it stalls (~4 min)
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_prefill_tma.py > "$OUT/gpu_tests.log" 2>&1
  tail -1 "$OUT/gpu_tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head
  timeout 240 python3 benchmarks/prefill_tma_bench.py --default-tile-only \
    --extra "fold_scale=1;rescale_slack=8;fold_scale=1,rescale_slack=8" --out "$OUT/prefill_softmax.md" 2>&1 | grep "^|"
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
if [[ $what == pending64 ]]; then
  # prepared in session 18 (issue 4): split_grain deals the context to the decode splits in runs of 16
  # positions instead of whole 64-key tiles, so a short context spreads over more splits (Ouro at 128: 8
  # splits of 16 keys, not 2 of 64) while every split keeps the 64-key tile; it is what made 16-key
  # tiles 2.5% faster at 128 (session 17), without narrowing the tile at long contexts. GPU parity first (~8 min)
  timeout 150 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_triton_kernels.py -k "decode_kernel_parity" \
    > "$OUT/gpu_tests.log" 2>&1
  tail -1 "$OUT/gpu_tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head
  # (Nanbeige's batch-1 GQA decode merges in the reduce kernel, whose split count is capped at the block
  # table's runs of the grain: more splits with split_grain=16)
  for cfg in "" split_grain=16 block_n=16 split_grain=32 ""; do
    echo "== context 128 RLT_ATTENTION_CONFIG=$cfg"
    RLT_ATTENTION_CONFIG=$cfg timeout 100 python3 -m rlt_compile.bench --model ouro-1.4b,nanbeige4.2-3b \
      --eager-steps 0 --compiled-steps 0 2>&1 | grep "graphs .* ms/token"
  done
  for cfg in "" split_grain=16 block_n=16; do
    echo "== context 4096 RLT_ATTENTION_CONFIG=$cfg"
    RLT_ATTENTION_CONFIG=$cfg timeout 60 python3 -m rlt_compile.bench --model ouro-1.4b --context 4096 \
      --eager-steps 0 --compiled-steps 0 2>&1 | grep "graphs .* ms/token"
  done
  timeout 150 python3 benchmarks/attention_bench.py --sweep --no-table --models Ouro --cases 1x128,1x1024,1x8192 \
    --extra "split_grain=16;split_grain=32;block_n=16" --out "$OUT/sweep_grain.md" > "$OUT/sweep_grain.log" 2>&1
  grep -E "\| (default|split_grain|block_n=16)" "$OUT/sweep_grain.md"
fi
if [[ $what == pending65 ]]; then
  # prepared in session 18 (issue 4), offline SASS: dependent memory round trips removed from the chain's
  # kernels, now the default: Ouro's sandwich norm (add_rmsnorm2) loaded its residual row only after norm
  # a's reduction, the q/k/v GEMV's rotary epilogue its cos/sin only after the K loop, and the decode
  # attention's split 0 its q only after storing the K/V row (early_q); all now load with the
  # activations, right after the PDL wait. And a candidate, off: acc_2d (one-row GEMVs sum their
  # products once after the loop, so no reduction and barrier sits between their weight loads).
  # GPU parity, the chain A/B (the compiled model's epilogues; the old orders; acc_2d), then Ouro-1.4B
  # and Nanbeige end to end with and without acc_2d, Ouro-1.4B with early_q=0 (~7 min; `final` runs all four)
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_fuse_rmsnorm.py tests/test_gemv.py \
    tests/test_fuse_rope_gemv.py tests/test_pdl.py > "$OUT/gpu_tests.log" 2>&1
  tail -1 "$OUT/gpu_tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head
  timeout 150 python3 benchmarks/gemv_chain_bench.py --variants --reps 20 --only "model epilogues" 2>&1 \
    | grep -E "^\| model"
  for cfg in acc_2d=1 ""; do
    echo "== RLT_GEMV_CONFIG=$cfg"
    RLT_GEMV_CONFIG=$cfg timeout 100 python3 -m rlt_compile.bench --model ouro-1.4b,nanbeige4.2-3b --eager-steps 0 \
      --compiled-steps 0 2>&1 | grep "graphs .* ms/token"
  done
  echo "== RLT_ATTENTION_CONFIG=early_q=0 (the decode attention's load order before session 18)"
  RLT_ATTENTION_CONFIG=early_q=0 timeout 60 python3 -m rlt_compile.bench --model ouro-1.4b --eager-steps 0 \
    --compiled-steps 0 2>&1 | grep "graphs .* ms/token"
fi
if [[ $what == pending66 ]]; then
  # session 20 (issue 4): 16-key decode tiles where the block table (or a short-context graph's
  # decode_context_limit) holds at most 256 positions and the unsplit grid is below a wave. GPU tests,
  # then all four models at context 128 against the old 64-key tiles (block_n=64), Ouro-1.4B at 4096,
  # and the tile sweep around the threshold (256 / 512) and at 8 rows (~10 min)
  # (the engine's GPU tests capture the short-context graphs by default: their tables are max_model_len wide)
  timeout 300 python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/test_graphs_gpu.py tests/test_triton_kernels.py \
    tests/test_engine_gpu.py -k "graph or decode_kernel_parity or engine" > "$OUT/gpu_tests.log" 2>&1
  tail -1 "$OUT/gpu_tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head
  for cfg in "" block_n=64; do
    echo "== context 128 RLT_ATTENTION_CONFIG=$cfg"
    RLT_ATTENTION_CONFIG=$cfg timeout 150 python3 -m rlt_compile.bench --model all --eager-steps 0 \
      --compiled-steps 0 2>&1 | grep "graphs .* ms/token"
  done
  echo "== context 4096"
  timeout 60 python3 -m rlt_compile.bench --model ouro-1.4b --context 4096 --eager-steps 0 --compiled-steps 0 2>&1 \
    | grep "graphs .* ms/token"
  timeout 150 python3 benchmarks/attention_bench.py --sweep --no-table --models Ouro,Nanbeige \
    --cases 1x128,1x256,1x512,8x128,8x256 --extra "block_n=64;block_n=16" --out "$OUT/sweep_short.md" \
    > "$OUT/sweep_short.log" 2>&1
  grep -E "\| (default|block_n=64|block_n=16) \|" "$OUT/sweep_short.md"
fi
if [[ $what == pending67 ]]; then
  # session 21 (issue 4): CudaGraphRunner.fill copies a batch into the static buffers with one
  # multi-tensor copy per dtype (graphs.FOREACH_FILL) instead of seven copies, which ran on the GPU
  # between two replays. GPU graph tests, then Ouro-1.4B and Nanbeige with and without, alternating,
  # then one profile each (its "copy" class counts the copies per token), then the engine at batch 1 (~7 min)
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_graphs_gpu.py > "$OUT/gpu_tests.log" 2>&1
  tail -1 "$OUT/gpu_tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head
  for grouped in True False True False; do
    echo "== FOREACH_FILL=$grouped"
    timeout 100 python3 -c "import sys, rlt_compile.graphs as g; g.FOREACH_FILL = $grouped
from rlt_compile import bench; bench.main(sys.argv[1:])" --model ouro-1.4b,nanbeige4.2-3b --eager-steps 0 \
      --compiled-steps 0 2>&1 | grep "graphs .* ms/token"
  done
  for grouped in True False; do
    timeout 100 python3 -c "import sys, rlt_compile.graphs as g; g.FOREACH_FILL = $grouped
from rlt_compile import bench; bench.main(sys.argv[1:])" --model ouro-1.4b --eager-steps 0 --compiled-steps 0 \
      --profile --out "$OUT/profile_fill_$grouped.md" > /dev/null 2>&1
    echo "== profile FOREACH_FILL=$grouped"; grep -o "GPU busy.*Top kernels" "$OUT/profile_fill_$grouped.md" | head -2
  done
  # the engine at batch 1 (what generate / serve run: sampler, input buffers, fill, replay), both ways
  for grouped in True False; do
    echo "== engine batch 1, FOREACH_FILL=$grouped"
    timeout 150 python3 -c "import sys, rlt_compile.graphs as g; g.FOREACH_FILL = $grouped
from rlt_compile import bench; bench.main(sys.argv[1:])" --engine-profile --model ouro-1.4b --batches 1 \
      --out "$OUT/engine_fill_$grouped.md" > "$OUT/engine_fill_$grouped.log" 2>&1
    grep -E "^\| 1 \|" "$OUT/engine_fill_$grouped.md"
  done
fi
if [[ $what == pending68 ]]; then
  # session 21 (issue 4): prefill / mixed-batch graphs (prefill_graphs.PrefillGraphRunner, off by default).
  # GPU tests of the graphs and the engine, then Ouro-1.4B's prefill step with and without a graph (fresh
  # prompts of 16 / 128 / 512 tokens, 15 decode rows + a 512-token chunk), then what a serving set of
  # buckets costs to capture (time, memory: tokens 16..2048 x sequences up to 256) (~7 min; pending69:
  # the other models and the engine bench, pending72: TTFT behind the server). If the graphs hold, make
  # them the default (EngineConfig)
  timeout 240 python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/test_graphs_gpu.py tests/test_engine_gpu.py \
    > "$OUT/gpu_tests.log" 2>&1
  tail -1 "$OUT/gpu_tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head
  timeout 120 python3 benchmarks/prefill_graph_bench.py --model ouro-1.4b --out "$OUT/prefill_graph_ouro-1.4b.md" \
    2>&1 | grep -E "^(\||Prefill|error)"
  timeout 180 python3 benchmarks/prefill_graph_bench.py --model ouro-1.4b --token-buckets 16,32,64,128,256,512,1024,2048 \
    --max-seqs 256 --reps 3 --out "$OUT/prefill_graph_all.md" 2>&1 | grep -E "^(Prefill|error)"
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
if [[ $what == pending72 ]]; then
  # session 21 (issue 4): TTFT and ITL behind the OpenAI server, compiled + decode graphs, with and without
  # prefill / mixed-step graphs (128-token prompts, 64 output tokens, concurrency 1 and 16) (~5 min)
  for graphs in "--prefill-graphs off" ""; do
    echo "== serve_bench --compile $graphs"
    timeout 150 python3 benchmarks/serve_bench.py --compile $graphs --concurrency 1,16 --time-limit 20 \
      --out "$OUT/serve${graphs:+_no_prefill_graphs}.md" 2>&1 | grep -E "^\|" | tail -4
  done
fi
if [[ $what == pending70 ]]; then
  # session 21 (issue 4): one projection's GEMV tiles end to end (RLT_GEMV_CONFIG only_n / only_k, new).
  # Sessions 13 and 14 found Ouro's o projection (2048 x 2048) 0.8-1.0% faster on the chain with 4 columns,
  # 2048-long runs and 8 warps, under the 1% bar then; acc_2d and 16-key attention tiles came since.
  # The chain's shape sweep first, then Ouro-1.4B end to end with the best o / down tiles, alternating (~6 min)
  timeout 200 python3 benchmarks/gemv_chain_bench.py --shape-sweep --reps 20 --out "$OUT/shape_sweep.md" \
    > "$OUT/shape_sweep.log" 2>&1
  grep -E "^\| (gemv default|o |down )" "$OUT/shape_sweep.md" | head -14
  o="only_n=2048,only_k=2048"; down="only_n=2048,only_k=5632"
  for cfg in "" "$o,block_n=4,block_k=2048,warps=8" "$o,block_k=2048" "$down,block_n=4,warps=8" "" \
      "$o,block_n=4,block_k=2048,warps=8"; do
    echo "== RLT_GEMV_CONFIG=$cfg"
    RLT_GEMV_CONFIG=$cfg timeout 60 python3 -m rlt_compile.bench --model ouro-1.4b --eager-steps 0 \
      --compiled-steps 0 2>&1 | grep "graphs .* ms/token"
  done
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
if [[ $what == pending73 ]]; then
  # session 22 (issues 4, 3), on whichever card comes: the GPU tests of the graphs, the engine and its
  # self-speculation after the short-context graphs' default fix (CudaGraphRunner captured them only when
  # use_graphs was passed as True), Ouro-1.4B's prefill step with and without graphs, the grouped fill and
  # the o projection's tiles end to end, each alternating with the default (~9 min)
  timeout 230 python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/test_graphs_gpu.py tests/test_engine_gpu.py \
    tests/test_engine_speculative.py > "$OUT/gpu_tests.log" 2>&1
  tail -1 "$OUT/gpu_tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head
  timeout 110 python3 benchmarks/prefill_graph_bench.py --model ouro-1.4b --out "$OUT/prefill_graph_ouro-1.4b.md" \
    2>&1 | grep -E "^(\||Prefill|error)"
  for grouped in True False True False; do
    echo "== FOREACH_FILL=$grouped"
    timeout 45 python3 -c "import sys, rlt_compile.graphs as g; g.FOREACH_FILL = $grouped
from rlt_compile import bench; bench.main(sys.argv[1:])" --model ouro-1.4b --eager-steps 0 \
      --compiled-steps 0 2>&1 | grep "graphs .* ms/token"
  done
  o="only_n=2048,only_k=2048"
  for cfg in "$o,block_n=4,block_k=2048,warps=8" "" "$o,block_k=2048"; do
    echo "== RLT_GEMV_CONFIG=$cfg"
    RLT_GEMV_CONFIG=$cfg timeout 45 python3 -m rlt_compile.bench --model ouro-1.4b --eager-steps 0 \
      --compiled-steps 0 2>&1 | grep "graphs .* ms/token"
  done
fi
if [[ $what == pending76 ]]; then
  # session 23 (issue 4): session 22's pending75 in one call with GPU tests of the GEMV and graphs after the
  # o tile's new default (pending74 / 75 became pending76-78): Ouro-1.4B end to end with the o projection's 4-column whole-row 8-warp tiles on the down
  # (also 4096-long runs), q/k/v (rotary epilogue) and gate/up (SwiGLU epilogue) GEMVs, one shape at a time
  # and together (RLT_GEMV_CONFIG entries separated by ';'), default runs between them (~9 min)
  timeout 150 python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/test_gemv.py tests/test_graphs_gpu.py \
    > "$OUT/gpu_tests.log" 2>&1
  tail -1 "$OUT/gpu_tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head
  down="only_n=2048,only_k=5632"; qkv="only_n=6144,only_k=2048"; gate_up="only_n=11264,only_k=2048"
  wide="block_n=4,block_k=2048,warps=8"
  for cfg in "" "$down,block_n=4,warps=8" "$down,block_k=4096,warps=8" "" "$qkv,$wide" "$gate_up,$wide" "" \
      "$qkv,$wide;$gate_up,$wide" "$qkv,$wide;$gate_up,$wide;$down,block_k=4096,warps=8" ""; do
    echo "== RLT_GEMV_CONFIG=$cfg"
    start=$SECONDS
    RLT_GEMV_CONFIG=$cfg timeout 45 python3 -m rlt_compile.bench --model ouro-1.4b --eager-steps 0 \
      --compiled-steps 0 2>&1 | grep "graphs .* ms/token"
    echo "   ($((SECONDS - start)) s)"
  done
fi
if [[ $what == pending77 ]]; then
  # session 23 (issue 4): the 4-column 2048-long 8-warp tiles now also on Ouro's down projection
  # (pending76, H100: 4.351 against 4.372-4.375 ms/token). GPU tests of the GEMV, the engine and its
  # self-speculation (prefill graphs on by default), the new down tile against the old one, the same tile
  # on Nanbeige's o and down (3072 x 6144 / 10752: 768 such programs, all resident) (~5 min, what the
  # session's device budget had left; pending78: the four-model table and the prefill buckets' capture)
  timeout 130 python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/test_gemv.py tests/test_engine_gpu.py \
    tests/test_engine_speculative.py > "$OUT/gpu_tests.log" 2>&1
  tail -1 "$OUT/gpu_tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head
  old_down="only_n=2048,only_k=5632,block_n=2,warps=4"
  for cfg in "" "$old_down"; do
    echo "== Ouro-1.4B, RLT_GEMV_CONFIG=$cfg"
    RLT_GEMV_CONFIG=$cfg timeout 40 python3 -m rlt_compile.bench --model ouro-1.4b --eager-steps 0 \
      --compiled-steps 0 2>&1 | grep "graphs .* ms/token"
  done
  wide="block_n=4,block_k=2048,warps=8"
  for cfg in "" "only_n=3072,only_k=6144,$wide;only_n=3072,only_k=10752,$wide"; do
    echo "== Nanbeige, RLT_GEMV_CONFIG=$cfg"
    RLT_GEMV_CONFIG=$cfg timeout 45 python3 -m rlt_compile.bench --model nanbeige4.2-3b --eager-steps 0 \
      --compiled-steps 0 2>&1 | grep "graphs .* ms/token"
  done
fi
if [[ $what == pending78 ]]; then
  # session 23 (issue 4): all four models on the new tree (the headline table), the default prefill
  # buckets' capture time, memory and replays (prompts of 16-2000 tokens), Ouro-2.6B with the o and down
  # tiles before session 22 (~6.5 min)
  timeout 190 python3 -m rlt_compile.bench --model all --eager-steps 1 --compiled-steps 0 --out "$OUT/bench_all.md" \
    2>&1 | grep "graphs .* ms/token"
  grep -E "^\| (Ouro|Nanbeige|Huginn)" "$OUT/bench_all.md"
  timeout 100 python3 benchmarks/prefill_graph_bench.py --model ouro-1.4b --engine-defaults --lengths 16,128,512,1000,2000 \
    --mixed 0 --reps 3 --out "$OUT/prefill_graph_defaults.md" 2>&1 | grep -E "^(\||Prefill|error)"
  old="only_n=2048,only_k=2048,block_n=2,block_k=1024,warps=4;only_n=2048,only_k=5632,block_n=2,warps=4"
  echo "== Ouro-2.6B, RLT_GEMV_CONFIG=$old (the o and down tiles before session 22)"
  RLT_GEMV_CONFIG=$old timeout 50 python3 -m rlt_compile.bench --model ouro-2.6b --eager-steps 0 --compiled-steps 0 \
    2>&1 | grep "graphs .* ms/token"
fi
if [[ $what == pending79 ]]; then
  # session 23 (issue 4): Ouro-1.4B's q/k/v and gate/up GEMVs with 2048-long runs (the whole row; 2 columns,
  # 4 warps: 10 programs per SM, so 1.2 / 2.1 waves against 0.7 / 1.3 with 1024-long runs), end to end
  # next to default runs (the decode chain of sessions 13-14 found no tile better, but it had also
  # understated the o tile's gain) (~4 min)
  qkv="only_n=6144,only_k=2048,block_k=2048"; gate_up="only_n=11264,only_k=2048,block_k=2048"
  for cfg in "" "$qkv" "$gate_up" "" "$qkv;$gate_up" ""; do
    echo "== RLT_GEMV_CONFIG=$cfg"
    RLT_GEMV_CONFIG=$cfg timeout 40 python3 -m rlt_compile.bench --model ouro-1.4b --eager-steps 0 \
      --compiled-steps 0 2>&1 | grep "graphs .* ms/token"
  done
fi
if [[ $what == pending80 ]]; then
  # session 23 (issue 4), the last ~2.5 minutes of its device budget: the GEMV's GPU parity with the new down
  # tile, then Ouro-1.4B with it and with the old one (pending77 without the engine tests and Nanbeige)
  timeout 75 python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/test_gemv.py > "$OUT/gpu_tests.log" 2>&1
  tail -1 "$OUT/gpu_tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head
  for cfg in "" "only_n=2048,only_k=5632,block_n=2,warps=4"; do
    echo "== Ouro-1.4B, RLT_GEMV_CONFIG=$cfg"
    RLT_GEMV_CONFIG=$cfg timeout 40 python3 -m rlt_compile.bench --model ouro-1.4b --eager-steps 0 \
      --compiled-steps 0 2>&1 | grep "graphs .* ms/token"
  done
fi
exit 0
