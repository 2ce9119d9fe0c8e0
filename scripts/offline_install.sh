#!/usr/bin/env bash
# Installs the offline wheel bundle made by scripts/offline_bundle.py on the air-gapped GPU host.
# Runs there, as root, with no network, from any directory (it uses the checkout it lives in).
#
#   bash scripts/offline_install.sh recv N   # chunk folder .cN/ arrived with the checkout: keep it
#   bash scripts/offline_install.sh install  # after the last chunk: reassemble, verify, install, check
#   bash scripts/offline_install.sh check    # import check only
#
# Chunks wait in $LORAPLEX_PARTS (default /tmp/loraplex-parts), which must survive between
# transfers; wheels go to $LORAPLEX_SITE (default /tmp/site). Afterwards every command needs
#   export PYTHONPATH=/tmp/site:<checkout> VLLM_USE_FLASHINFER_SAMPLER=0
set -Eeuo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PARTS=${LORAPLEX_PARTS:-/tmp/loraplex-parts}
SITE=${LORAPLEX_SITE:-/tmp/site}
WORK=${LORAPLEX_WORK:-/tmp/loraplex-unpack}
PY=${PYTHON:-python3}

die() { echo "offline_install: $*" >&2; exit 1; }
trap 'echo "offline_install: failed at line $LINENO: $BASH_COMMAND" >&2' ERR
step() {  # step LABEL CMD...: run CMD, print how long it took
  local label=$1 t0=$SECONDS; shift
  "$@"
  echo "[$label] $((SECONDS - t0)) s"
}

recv() {
  local n=${1:-}
  [[ $n =~ ^[0-9]+$ ]] || die "usage: recv N (N = the chunk number)"
  local src="$ROOT/.c$n"
  [ -d "$src" ] || die "no .c$n/ in $ROOT: send that chunk folder along with the checkout"
  compgen -G "$src/part.*" >/dev/null || die ".c$n/ holds no part file"
  mkdir -p "$PARTS"
  mv -f "$src"/* "$PARTS"/
  rmdir "$src"
  echo "chunk $n kept in $PARTS: $(ls "$PARTS" | tr '\n' ' ')"
  df -h "$PARTS" | tail -1
}

reassemble() {
  [ -f "$PARTS/LAST" ] || die "no LAST marker in $PARTS: the last chunk has not been received"
  local last i missing=()
  last=$(tr -dc '0-9' <"$PARTS/LAST")
  [ -n "$last" ] || die "$PARTS/LAST is empty"
  for i in $(seq 1 "$last"); do
    [ -f "$PARTS/$(printf 'part.%02d' "$i")" ] || missing+=("$i")
  done
  [ ${#missing[@]} -eq 0 ] || die "chunks missing (recv them first): ${missing[*]} of $last"
  [ -f "$PARTS/bundle.sha256" ] || die "no bundle.sha256 in $PARTS"
  rm -rf "$WORK" && mkdir -p "$WORK"
  for i in $(seq 1 "$last"); do cat "$PARTS/$(printf 'part.%02d' "$i")"; done >"$WORK/bundle.tar.xz"
  (cd "$WORK" && sha256sum -c --strict "$PARTS/bundle.sha256") || die "bundle checksum mismatch"
}

extract() {
  if command -v xz >/dev/null; then
    xz -dc "$WORK/bundle.tar.xz" | tar -xf - -C "$WORK"
  else
    "$PY" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="data")' \
      "$WORK/bundle.tar.xz" "$WORK"
  fi
  rm -f "$WORK/bundle.tar.xz"
  compgen -G "$WORK/wheels/*.whl" >/dev/null || die "the bundle holds no wheels"
  echo "$(ls "$WORK"/wheels/*.whl | wc -l) wheels, $(du -sh "$WORK/wheels" | cut -f1)"
}

pip_install() {
  local log="$WORK/pip-install.log"
  if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" "$WORK"/wheels/*.whl >"$log" 2>&1; then
    tail -30 "$log" >&2
    die "pip install failed (log: $log)"
  fi
  grep -v '^WARNING: Target directory' "$log" | tail -5 || true
  echo "installed into $SITE ($(du -sh "$SITE" | cut -f1))"
}

check() {
  [ -d "$SITE" ] || die "$SITE does not exist: run install first"
  PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" VLLM_USE_FLASHINFER_SAMPLER=0 "$PY" - "$SITE" <<'EOF' \
    || die "import check failed"
import importlib.metadata as md
import sys
import time

site = sys.argv[1]
t = time.monotonic()
import vllm, ray, ray.serve, boto3, moto.server, openai  # noqa: E401,F401
import vllm._C_stable_libtorch, vllm._moe_C_stable_libtorch  # noqa: E401,F401  CUDA extensions
from vllm.platforms import current_platform
from vllm.vllm_flash_attn.flash_attn_interface import FA3_AVAILABLE

for name in ("vllm", "ray", "boto3", "botocore", "moto", "openai", "numpy", "numba", "torch",
             "transformers"):
    dist = md.distribution(name)
    where = "bundle" if str(dist.locate_file("")).startswith(site) else "image"
    print(f"  {name:13s} {dist.version:12s} ({where})")
print(f"  platform {type(current_platform).__name__}, FA3 available: {FA3_AVAILABLE}")
if not vllm.__file__.startswith(site):
    sys.exit(f"vllm was imported from {vllm.__file__}, not from {site}")
try:  # the peer the serving benchmarks compare with: reported, not required by loraplex
    from ray.serve.llm import build_openai_app  # noqa: F401
    print("  ray.serve.llm: imports")
except ImportError as err:
    wants = [r for r in md.requires("ray") or [] if r.startswith("vllm") and "llm" in r]
    print(f"  ray.serve.llm does NOT import: {err.__cause__ or err}; ray {ray.__version__} [llm] "
          f"wants {', '.join(wants) or 'no vllm'}, the bundle has vllm {vllm.__version__}")
print(f"IMPORT_CHECK OK ({time.monotonic() - t:.1f} s)")
EOF
}

install() {
  step reassemble reassemble
  step extract extract
  step pip-install pip_install
  rm -rf "$WORK" "$PARTS"
  step check check
}

case ${1:-} in
  recv) step recv recv "${2:-}" ;;
  install) step total install ;;
  check) step check check ;;
  *) die "usage: $0 recv N | install | check" ;;
esac
