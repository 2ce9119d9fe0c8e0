#!/usr/bin/env bash
# Install and run s3rver (npm), the on-disk, credential-checking local S3 server used by tests.
#   scripts/s3rver.sh install PREFIX            -> installs s3rver@3.7.1 under PREFIX (idempotent)
#   scripts/s3rver.sh run PREFIX DATA_DIR PORT  -> runs it in the foreground on 127.0.0.1:PORT
# Credentials are s3rver's defaults (access key S3RVER, secret S3RVER).
set -euo pipefail
VERSION="3.7.1"
cmd="${1:-}"
prefix="${2:-}"
if [[ -z "$cmd" || -z "$prefix" ]]; then
  echo "usage: $0 install PREFIX | run PREFIX DATA_DIR PORT" >&2
  exit 64
fi
bin="$prefix/node_modules/.bin/s3rver"
case "$cmd" in
  install)
    command -v npm >/dev/null || { echo "npm not found: install Node.js 18+ to run the s3rver tests" >&2; exit 3; }
    if [[ ! -x "$bin" ]]; then
      mkdir -p "$prefix"
      npm install --prefix "$prefix" --no-audit --no-fund --loglevel=error "s3rver@$VERSION" >&2
    fi
    echo "$bin"
    ;;
  run)
    data="${3:?data dir}"; port="${4:?port}"
    mkdir -p "$data"
    exec "$bin" -d "$data" -a 127.0.0.1 -p "$port" --silent
    ;;
  *)
    echo "unknown command $cmd" >&2; exit 64 ;;
esac
