#!/usr/bin/env bash
# Build an overlay folder holding another vLLM release (default 0.32.0) for the compatibility
# test: `PYTHONPATH=.venv-vllm032 .venv/bin/tailproof ...` then imports that vLLM instead of the
# venv's 0.33 (everything else, torch included, still comes from .venv). --no-deps: only vLLM's
# own files change. Idempotent; prints the folder on stdout.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION="${1:-0.32.0}"
DIR="${2:-.venv-vllm$(echo "$VERSION" | cut -d. -f1-2 | tr -d .)}"
VENV="${TAILPROOF_VENV:-.venv}"
if [ ! -d "$DIR/vllm-$VERSION.dist-info" ]; then
  rm -rf "$DIR.tmp"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps \
    --target "$DIR.tmp" "vllm==$VERSION" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
  rm -rf "$DIR"
  mv "$DIR.tmp" "$DIR"
fi
echo "$DIR"
