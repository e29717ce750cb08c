#!/usr/bin/env bash
# Build the dry run's stand-in for the lent GPU machine's Python (default .venv-device/,
# git-ignored, about 4 GB): Python 3.12 holding only packages the machine's image holds
# (requirements/device/image-packages.txt), at its versions where known, so that
# `make device-dryrun` installs the pack into it with --no-index exactly as the machine does.
# torch is the image's own build, 2.11.0+cu130: PyPI's Linux wheel of 2.11.0 (no CPU build of
# it can be reached here), with the CUDA libraries it links so that it imports on a machine
# without a GPU; those come from this machine's local package folders (pip's file:// indexes)
# when they hold them, else from the registry at the versions torch names. Idempotent: re-runs
# only when this script or requirements/device/*.txt change. Prints the venv's python.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${TAILPROOF_DEVICE_VENV:-.venv-device}"
stamp="$VENV/.tailproof-stamp"
want="$(cat requirements/device/*.txt scripts/device_dryrun_venv.sh | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "$VENV/bin/python"
  exit 0
fi
log() { echo "device_dryrun_venv: $*" >&2; }
norm() { tr 'A-Z' 'a-z' | sed 's/[-_.]\+/-/g'; }

# Python 3.12, as on the machine: PYTHON312, else python3.12 if it runs, else pyenv's.
py312="${PYTHON312:-}"
if [ -z "$py312" ]; then
  if python3.12 -c '' 2>/dev/null; then
    py312=python3.12
  else
    py312="$(ls -d "$(pyenv root 2>/dev/null || echo ~/.pyenv)"/versions/3.12*/bin/python3.12 \
             2>/dev/null | tail -n 1)"
  fi
fi
[ -n "$py312" ] && "$py312" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null \
  || { log "no Python 3.12 found (set PYTHON312=/path/to/python3.12)"; exit 1; }

rm -rf "$VENV"
"$py312" -m venv "$VENV"
VPY="$VENV/bin/python"
pip_q() { "$VPY" -m pip "$@" -q --disable-pip-version-check \
            2> >(grep -v -e "is ignored: it is neither a file nor a directory" \
                         -e "dependency resolver does not currently" -e "^torch 2.11.0 requires" >&2); }

log "torch 2.11.0 (the image's build, +cu130; --no-deps)"
pip_q install --no-deps torch==2.11.0
# The CUDA libraries torch's own libraries link (readelf -d torch/lib/libtorch_cuda.so): all of
# them must load for `import torch`, none is used without a GPU.
cuda_libs=(nvidia-cuda-runtime nvidia-cublas nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile
           nvidia-curand nvidia-cusparse nvidia-cusparselt-cu13 nvidia-nccl-cu13 nvidia-nvjitlink
           nvidia-nvshmem-cu13)
local_idx=($("$VPY" -m pip config list 2>/dev/null | grep -o "file://[^ ']*" | sort -u || true))
local_ok=false
if [ "${#local_idx[@]}" -gt 0 ]; then
  idx=(--index-url "${local_idx[0]}")
  for u in "${local_idx[@]:1}"; do idx+=(--extra-index-url "$u"); done
  if pip_q install --no-deps "${idx[@]}" "${cuda_libs[@]}" 2>/dev/null; then
    local_ok=true
    log "CUDA libraries from this machine's package folders: ${local_idx[*]}"
  fi
fi
if ! $local_ok; then
  log "CUDA libraries from the registry (torch 2.11.0's pins)"
  pip_q install --no-deps "${cuda_libs[@]}"
fi

log "the image's packages the check uses (requirements/device/image.txt)"
cons="$VENV/image-only-constraints.txt"
{ grep -v '^#' requirements/device/not-in-image.txt
  grep -v -e '^#' -e '^$' requirements/device/pack.txt | sed 's/[=<> #].*//; s/$/<0/'; } > "$cons"
pip_q install -c "$cons" -r requirements/device/image.txt
"$VPY" -c 'import torch; assert torch.__version__.startswith("2.11.0"), torch.__version__' \
  || { log "torch 2.11.0 does not import"; exit 1; }

# Only the image's packages, and none the pack carries (else the dry run would hide a gap).
image="$(grep -v '^#' requirements/device/image-packages.txt | norm)"
pack="$(grep -v -e '^#' -e '^$' requirements/device/pack.txt | sed 's/[=<> #].*//' | norm)"
extra=()
for p in $("$VPY" -m pip list --format=freeze 2>/dev/null | sed 's/==.*//' | norm); do
  if ! echo "$image" | grep -qx "$p" || echo "$pack" | grep -qx "$p"; then
    extra+=("$p")
  fi
done
if [ "${#extra[@]}" -gt 0 ]; then
  log "the venv holds packages the machine's image lacks: ${extra[*]}"
  exit 1
fi
echo "$want" > "$stamp"
log "ready: $VENV ($("$VPY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__)'))"
echo "$VPY"
