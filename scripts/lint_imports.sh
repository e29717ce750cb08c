#!/usr/bin/env bash
# Check the import contracts of pyproject.toml ([tool.importlinter]) with import-linter.
# Why a temporary tree: the package maps tailproof.<part> onto top-level folders (package-dir),
# which the editable install resolves through a finder that grimp cannot walk; a tree of
# symlinks tailproof/{spec,reference,impl,conformance} -> the folders gives it the real layout.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${TAILPROOF_VENV:-.venv}"
case "$VENV" in /*) ;; *) VENV="$root/$VENV" ;; esac
tree="$(mktemp -d)"
trap 'rm -rf "$tree"' EXIT
mkdir "$tree/tailproof"
for f in "$root"/tailproof/*.py; do ln -s "$f" "$tree/tailproof/"; done
for part in spec reference impl conformance; do ln -s "$root/$part" "$tree/tailproof/$part"; done
# Run outside the checkout so that its own tailproof/ folder does not shadow the tree.
cd "$tree"
PYTHONPATH="$tree" "$VENV/bin/lint-imports" "$root/pyproject.toml" --no-logo --no-cache "$@"
