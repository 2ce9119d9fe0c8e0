#!/usr/bin/env bash
# Checks the production Serve configs with the installed vLLM (0.24 on an H200): vLLM's own
# parser for both, and the whole VllmConfig of deploy/h200.yaml against a GPT-OSS-20B-shaped
# stand-in config.json (no weights needed).   Usage: bash deploy/check_h200_configs.sh [OUT_DIR]
set -uo pipefail
OUT=${1:-check-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import vllm, torch, sys; print('vllm', vllm.__version__, 'torch', torch.__version__, 'python', sys.version.split()[0])" | tee -a "$OUT/gpu.txt"
for cfg in deploy/h200.yaml deploy/qwen3-30b-a3b.yaml; do
  echo "== parse $cfg"; python3 deploy/check_engine_args.py "$cfg" 2>&1 | tail -3 | tee -a "$OUT/parse.txt"
done
OUT="$OUT" python3 - <<'PY'
import os
from transformers import GptOssConfig
c = GptOssConfig(hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
                 num_key_value_heads=8, head_dim=64, num_local_experts=32, vocab_size=201088)
c.architectures = ["GptOssForCausalLM"]
c.quantization_config = {"quant_method": "mxfp4"}
c.save_pretrained(os.path.join(os.environ["OUT"], "gptoss-standin"))
PY
echo "== full deploy/h200.yaml"; timeout 240 python3 deploy/check_engine_args.py deploy/h200.yaml --model-dir "$OUT/gptoss-standin" --full 2>&1 | tail -6 | tee "$OUT/full.txt"
