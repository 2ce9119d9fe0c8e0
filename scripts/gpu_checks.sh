#!/usr/bin/env bash
# On a CUDA host with vLLM 0.24 (scripts/offline_install.sh, packages in /tmp/site): every test
# file with GPU tests, then the MoE-LoRA and dense LoRA kernel benchmarks, logs into OUT_DIR;
# `engine`: the engine serving benchmark, bf16 then MXFP4 (no LoRA vs loraplex, the settings of
# benchmarks/RESULTS.md's engine sections; ~10 min: a command of its own).
# `ranks`: adapters of rank 32 (16 for the equality) in slots of rank 64, as deploy/h200.yaml runs
# them: the slot-rank kernel benchmark, equality with stock vLLM, the engine serving benchmark on
# MXFP4 (~9 min: a command of its own).
# `timeline`: per model the decode step's device timeline with adapters, LoRA on without and
# LoRA off (step_profile --decode-trace, then decode_timeline; ~4 min per model). `fused`: the
# dense LoRA bench at decode sizes with the one-launch form's columns.
#   bash scripts/gpu_checks.sh OUT_DIR [tests|bench|all|engine|ranks|timeline|fused] [MODELS (engine, timeline: default 'gptoss gptoss-mxfp4')]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?OUT_DIR}
WHAT=${2:-all}
MODELS=${3:-gptoss gptoss-mxfp4}
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 \
       HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv,noheader \
    | tee "$OUT/gpu.txt"
python3 -c "import vllm, torch, triton, sys; print('vllm', vllm.__version__, 'torch', torch.__version__, \
'triton', triton.__version__, 'python', sys.version.split()[0])" | tee -a "$OUT/gpu.txt"
python3 scripts/register_entry_points.py --target /tmp/site \
    --entry-point vllm.general_plugins:loraplex_balanced_dummy=benchmarks.engine.gpt_oss_dummy:register
status=0
if [ "$WHAT" = ranks ]; then
  python3 -m benchmarks.kernels.slot_ranks --ms 1,4,16,64,256 --layers 16 --json "$OUT/slot_ranks.json" \
      2>&1 | tee "$OUT/slot_ranks.log" | tail -9
  status=${PIPESTATUS[0]}
  python3 -m benchmarks.engine.equality --mxfp4 --rank 16 --max-lora-rank 64 \
      --json "$OUT/equality_r16_slots_r64.json" 2>&1 | tee "$OUT/equality_r16_slots_r64.log" | tail -7
  status=$(( status || PIPESTATUS[0] ))
  python3 -m benchmarks.engine.serving --model gptoss-mxfp4 --runs base,loraplex --max-graph 64 \
      --burst-reps 2 --per-worker 2 --max-lora-rank 64 --json "$OUT/engine_serving_slots_r64.json" \
      2>&1 | tee "$OUT/engine_serving_slots_r64.log" | tail -12
  exit $(( status || PIPESTATUS[0] ))
fi
if [ "$WHAT" = fused ]; then
  python3 -m benchmarks.kernels.dense_lora --ms 1,4,16,32,64 --ops qkv,o --fused 128,256,512 \
      --json "$OUT/dense_lora_fused.json" 2>&1 | tee "$OUT/dense_lora_fused.log" | tail -24
  exit "${PIPESTATUS[0]}"
fi
if [ "$WHAT" = timeline ]; then
  # TIMELINE_TAG: a variant's name (its output folder); TIMELINE_BASE=0: no LoRA-off engine
  base=--base-engine; [ "${TIMELINE_BASE:-1}" = 0 ] && base=""
  for model in $MODELS; do
    flag=""; [ "$model" = gptoss-mxfp4 ] && flag=--mxfp4
    dir="$OUT/timeline_$model${TIMELINE_TAG:+_$TIMELINE_TAG}"
    python3 -m benchmarks.profiling.step_profile $flag $base --decode-steps 32 --top 25 \
        --decode-trace "$dir" --json "$dir.json" > "$dir.log" 2>&1
    status=$(( status || $? ))
    grep -v "^INFO\|^WARNING\|^(EngineCore\|^DEBUG" "$dir.log" | grep "^|\|^$\|ms per step\|top " | tail -45
    cols=("with adapters=$dir/decode_with_adapters.json.gz"
          "LoRA on, no adapter=$dir/decode_LoRA_on_no_adapter.json.gz")
    [ -n "$base" ] && cols+=("LoRA off=$dir/decode_LoRA_off.json.gz")
    python3 -m benchmarks.profiling.decode_timeline "${cols[@]}" --layer 2 --expect-steps 16 --png "$dir.png" \
        --json "$dir.timeline.json" 2>&1 | tee "$dir.timeline.log" | head -60
  done
  exit "$status"
fi
if [ "$WHAT" = engine ]; then
  for model in $MODELS; do
    python3 -m benchmarks.engine.serving --model "$model" --runs base,loraplex --max-graph 64 --burst-reps 2 \
        --per-worker 2 --json "$OUT/engine_serving_$model.json" 2>&1 | tee "$OUT/engine_serving_$model.log" | tail -12
    status=$(( status || PIPESTATUS[0] ))
  done
  exit "$status"
fi
if [ "$WHAT" != bench ]; then
  GPU_TESTS=(tests/kernels/test_triton_moe_lora.py tests/kernels/test_triton_moe_lora_rowmap.py
             tests/kernels/test_triton_dense_lora.py tests/kernels/test_triton_launch.py
             tests/kernels/test_kept_matmul_ogs.py tests/kernels/test_mxfp4_routing.py
             tests/kernels/vllm/test_vllm_cuda.py tests/kernels/vllm/test_vllm_cuda_live.py
             tests/kernels/vllm/test_vllm_cuda_mapping.py tests/kernels/vllm/test_vllm_cuda_mxfp4.py
             tests/kernels/vllm/test_vllm_cuda_mxfp4_apply.py tests/kernels/vllm/test_lora_pinning.py
             tests/kernels/vllm/test_pinned_region.py tests/benchmarks/test_host_pinning.py)
  t0=$(date +%s)
  # -v: every test's name and outcome in the log as it ends, so a run stopped by a time limit still names them
  python3 -m pytest -v -rs -p no:cacheprovider "${GPU_TESTS[@]}" 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
  status=${PIPESTATUS[0]}
  echo "GPU tests: exit $status in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/gpu_tests.log"
fi
if [ "$WHAT" != tests ]; then
  python3 -m benchmarks.kernels.moe_lora --json "$OUT/moe_lora_bench.json" 2>&1 | tee "$OUT/moe_lora_bench.log" | tail -12
  python3 -m benchmarks.kernels.dense_lora --ms 1,16,256,1616 --json "$OUT/dense_lora_bench.json" 2>&1 \
      | tee "$OUT/dense_lora_bench.log" | tail -16
fi
exit "$status"
