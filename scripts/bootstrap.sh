#!/usr/bin/env bash
# Build the project venv (default .venv) from the repo's own pinned files; idempotent.
# torch is the CPU build (2.13.0: the machine's wheel folder, or PyTorch's CPU index where
# TAILPROOF_TORCH_INDEX names it); every vLLM release goes in with --no-deps so pip never pulls
# a CUDA torch. The newest supported release is the venv's own; each other release of
# requirements/vllm-releases.txt goes in an overlay folder beside it (.venv-vllm033, ...),
# which PYTHONPATH puts first (scripts/vllm_env.sh). Re-runs only when a pinned file changes.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${TAILPROOF_VENV:-.venv}"
PY="${PYTHON:-python3.11}"
C=requirements/constraints.txt
stamp="$VENV/.tailproof-stamp"
want="$(cat requirements/*.txt pyproject.toml setup.py scripts/bootstrap.sh | sha256sum | cut -d' ' -f1)"
overlays_present() {
  grep '^vllm==' requirements/vllm-releases.txt | tail -n +2 | while read -r pin _; do
    v="${pin#vllm==}"
    [ -d ".venv-vllm$(echo "$v" | cut -d. -f1-2 | tr -d .)/vllm-$v.dist-info" ] || echo missing
  done | grep -q missing && return 1 || return 0
}
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && overlays_present; then
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
# A machine without the CPU wheel in pip's find-links gets it from PyTorch's CPU index:
# TAILPROOF_TORCH_INDEX=https://download.pytorch.org/whl/cpu (the plain index has only CUDA builds).
torch_index=()
[ -n "${TAILPROOF_TORCH_INDEX:-}" ] && torch_index=(--index-url "$TAILPROOF_TORCH_INDEX")
log "torch 2.13.0 (CPU build)"
"${pip[@]}" -c "$C" "${torch_index[@]}" torch==2.13.0
check_cpu_torch() {
  "$VENV/bin/python" - <<'PYEOF'
import sys, importlib.metadata as md
v = md.version("torch")
if "+cpu" not in v:
    sys.exit(f"bootstrap: torch {v} is not the CPU build; put torch-2.13.0+cpu in pip's "
             "find-links or set TAILPROOF_TORCH_INDEX=https://download.pytorch.org/whl/cpu")
PYEOF
}
check_cpu_torch
log "the runtime packages vLLM's core imports"
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
default_vllm="$(grep -m1 '^vllm==' requirements/vllm-releases.txt | awk '{print $1}')"
log "$default_vllm (--no-deps, the default release)"
"${pip[@]}" --no-deps "$default_vllm"
"${pip[@]}" --no-deps -e .
# The other releases as overlays (pure files, --no-deps): the same packages serve every release
# (their Requires-Dist bounds overlap on constraints.txt).
grep '^vllm==' requirements/vllm-releases.txt | tail -n +2 | while read -r pin _; do
  log "$pin (--no-deps, overlay $(./scripts/vllm_overlay.sh "${pin#vllm==}"))"
done
check_cpu_torch
echo "$want" > "$stamp"
log "ready: $VENV"
