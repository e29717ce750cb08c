#!/usr/bin/env bash
# Print the PYTHONPATH that selects one installed vLLM release: empty for the venv's own (the
# default, the first line of requirements/vllm-releases.txt), else its overlay folder
# (.venv-vllm033 for 0.33). Usage: PYTHONPATH="$(scripts/vllm_env.sh 0.33)" .venv/bin/pytest
# `scripts/vllm_env.sh --supported` prints the supported releases, newest first (0.34 0.33).
# Exits 2 with one line when the release is not one the bootstrap installs.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--supported" ]; then
  awk '/^vllm==/ && $2 == "supported" {split(substr($1, 7), v, "."); printf "%s%s.%s", sep, v[1], v[2]; sep=" "} END {print ""}' requirements/vllm-releases.txt
  exit 0
fi
want="${1:?usage: scripts/vllm_env.sh RELEASE (e.g. 0.33) | --supported}"
minor="$(echo "$want" | cut -d. -f1-2)"
default="$(grep -m1 '^vllm==' requirements/vllm-releases.txt | cut -d= -f3)"
if [ "$(echo "$default" | cut -d. -f1-2)" = "$minor" ]; then
  echo ""
  exit 0
fi
dir=".venv-vllm$(echo "$minor" | tr -d .)"
if ! grep -q "^vllm==$minor\." requirements/vllm-releases.txt || [ ! -d "$dir" ]; then
  echo "vllm_env: vLLM $want is not installed (fix: list it in requirements/vllm-releases.txt and run scripts/bootstrap.sh)" >&2
  exit 2
fi
echo "$PWD/$dir"
