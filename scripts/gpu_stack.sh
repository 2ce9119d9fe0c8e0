#!/usr/bin/env bash
# On a CUDA host with vLLM 0.24 and Ray 2.60 installed offline (scripts/offline_install.sh, packages in
# /tmp/site): the whole stack comparison of benchmarks/gpu_stack.py, its JSON, tables, plot and log in OUT_DIR.
#   bash scripts/gpu_stack.sh OUT_DIR [default|full] [further options of python3 -m benchmarks.gpu_stack]
# The work folder (model folder, adapters, configs, server logs) is $GPU_STACK_WORKDIR (default
# /tmp/loraplex-gpu-stack); adapter folders written there are reused by the next run.
# Under a time limit, give the kill a minute after the TERM (`timeout -k 60 540 bash scripts/gpu_stack.sh ...`):
# the benchmark then stops every server and engine within seconds (benchmarks/stacks/process.py hurry()).
# The default plan takes ~20 min on one H200: run it as a few commands of one or two systems each
# (--systems), each later one with --merge OUT_DIR_OF_THE_ONE_BEFORE/gpu_stack.json, on one machine start.
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
# in the background with the signals forwarded: a TERM to this script or its group (`timeout`)
# reaches the benchmark, which stops the servers it started (Ray's daemons outlive a killed
# parent); tee ignores it and ends with the benchmark's output, so the stop is logged
WORKDIR=${GPU_STACK_WORKDIR:-/tmp/loraplex-gpu-stack}
python3 -m benchmarks.gpu_stack --plan "$PLAN" --out "$OUT" --workdir "$WORKDIR" "$@" > >(trap "" TERM INT; exec tee "$OUT/gpu_stack.log") 2>&1 &
pid=$!
trap 'kill -TERM "$pid" 2>/dev/null' TERM INT
status=0
wait "$pid" || status=$?
while kill -0 "$pid" 2>/dev/null; do  # a trapped signal ends the first wait early
  status=0
  wait "$pid" || status=$?
done
# the servers' logs and their Ray clusters' logs (replica starts and deaths), in one file
(cd "$WORKDIR" && find . -maxdepth 2 \( -name '*.log' -o -name '*-ray-logs' \) -print0 \
   | tar czf "$OUT/server-logs.tgz" --null -T -) || true
exit "$status"
