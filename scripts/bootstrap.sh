#!/usr/bin/env bash
# Build the project venv (default .venv) from the repo's own pinned files; idempotent.
# torch is the CPU build (2.13.0 from the machine's wheel folder); vLLM 0.33.0 goes in with
# --no-deps so pip never pulls a CUDA torch. Re-runs only when a requirements file changes.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${TAILPROOF_VENV:-.venv}"
PY="${PYTHON:-python3.11}"
C=requirements/constraints.txt
stamp="$VENV/.tailproof-stamp"
want="$(cat requirements/*.txt pyproject.toml setup.py scripts/bootstrap.sh | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
log() { echo "bootstrap: $*" >&2; }

# The real Mooncake store links libibverbs even over TCP.
if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1'; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    log "installing libibverbs1 (needed by mooncake.store)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null
  else
    log "warning: libibverbs1 missing and cannot apt-get it; Mooncake tests will be skipped"
  fi
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip=(pip_quiet "$VENV/bin/python" -m pip install -q --disable-pip-version-check)
# pip warns once per package about index folders that do not exist on this machine; drop only
# those lines and keep every other message.
pip_quiet() { "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
log "torch 2.13.0 (CPU build)"
"${pip[@]}" -c "$C" torch==2.13.0
check_cpu_torch() {
  "$VENV/bin/python" - <<'PYEOF'
import sys, importlib.metadata as md
v = md.version("torch")
if "+cpu" not in v:
    sys.exit(f"bootstrap: torch {v} is not the CPU build; put torch-2.13.0+cpu in pip's find-links")
PYEOF
}
check_cpu_torch
log "the runtime packages vLLM 0.33's core imports"
"${pip[@]}" -c "$C" -r requirements/vllm-runtime.txt
# xgrammar declares triton (~1 GB) but importing it does not need it.
"${pip[@]}" --no-deps -c "$C" xgrammar apache-tvm-ffi
log "what vLLM's real engine and vllm serve import (the real-engine test bed)"
"${pip[@]}" -c "$C" -r requirements/vllm-engine.txt
# compressed-tensors declares torch: without its dependencies (loguru, pydantic and
# transformers are already in).
"${pip[@]}" --no-deps -c "$C" compressed-tensors
log "proof, test and store tools"
"${pip[@]}" -c "$C" -r requirements/dev.txt
# vLLM last and without its dependencies: its full set (CUDA torch, GPU kernels) is not needed
# for the core modules, and installing it last keeps pip from re-listing what it would want.
log "vllm 0.33.0 (--no-deps)"
"${pip[@]}" --no-deps vllm==0.33.0
"${pip[@]}" --no-deps -e .
check_cpu_torch
echo "$want" > "$stamp"
log "ready: $VENV"
