#!/usr/bin/env bash
# On a CUDA host with vLLM 0.24 and Ray 2.60 installed offline (scripts/offline_install.sh, packages in
# /tmp/site): the whole stack comparison of benchmarks/gpu_stack.py, its JSON, tables, plot and log in OUT_DIR.
#   bash scripts/gpu_stack.sh OUT_DIR [default|full] [further options of python3 -m benchmarks.gpu_stack]
# The work folder (model folder, adapters, configs, server logs) is $GPU_STACK_WORKDIR (default
# /tmp/loraplex-gpu-stack); adapter folders written there are reused by the next run.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?OUT_DIR}
PLAN=${2:-default}
shift $(( $# < 2 ? $# : 2 ))
SITE=${LORAPLEX_SITE:-/tmp/site}
export PYTHONPATH=$SITE:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 \
       HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
mkdir -p "$OUT"
# loraplex's vLLM plugin and the balanced-dummy-weights plugin, found through package metadata
python3 scripts/register_entry_points.py --target "$SITE" \
    --entry-point vllm.general_plugins:loraplex_balanced_dummy=benchmarks.engine.gpt_oss_dummy:register
python3 -m benchmarks.gpu_stack --plan "$PLAN" --out "$OUT" \
    --workdir "${GPU_STACK_WORKDIR:-/tmp/loraplex-gpu-stack}" "$@" 2>&1 | tee "$OUT/gpu_stack.log"
exit "${PIPESTATUS[0]}"
