#!/usr/bin/env bash
# Build the folder the GPU check carries to a lent machine (default .devpack/, git-ignored),
# where nothing can be fetched and a run carries 64 MiB in all, the working tree included:
#   wheels/tailproof-*.whl  the project, built from the files a run sends;
#   vllm-X.tar.xz           each supported release (requirements/vllm-releases.txt): its
#                           pure-Python sources from the bootstrap's install (no compiled .so);
#   wheels/*.whl            cp312 manylinux wheels of every package the check imports that the
#                           machine's image lacks (requirements/device/pack.txt);
#   MANIFEST.txt            the pack's size against its limit, and every file's size and hash.
# Fails, keeping the previous pack, when the new one is over DEVPACK_LIMIT_MIB (default 48).
# Needs .venv (make venv); fetches only the wheels an earlier pack does not already hold.
# Usage: scripts/device_pack.sh   (then scripts/device_check.sh there, with .devpack carried)
set -euo pipefail
cd "$(dirname "$0")/.."
PACK="${DEVPACK:-.devpack}"
LIMIT_MIB="${DEVPACK_LIMIT_MIB:-48}"
VENV="${TAILPROOF_VENV:-.venv}"
PY="$VENV/bin/python"
LIST=requirements/device/pack.txt
log() { echo "device_pack: $*" >&2; }
[ -x "$PY" ] || { log "no $VENV: run make venv first (the vLLM sources come from its installs)"; exit 1; }

tmp="$PACK.tmp"
src="$(mktemp -d)"
trap 'rm -rf "$tmp" "$src"' EXIT
rm -rf "$tmp"
mkdir -p "$tmp/wheels"
norm() { echo "$1" | tr 'A-Z' 'a-z' | sed 's/[-_.]\+/_/g'; }

# The project, as a wheel of exactly the files a run sends (tracked, or untracked and not
# ignored), built in a scratch copy so that no build/ folder lands in the checkout.
git ls-files -z --cached --others --exclude-standard -- \
    pyproject.toml setup.py README.md tailproof spec reference impl conformance \
  | while IFS= read -r -d '' f; do [ -f "$f" ] && printf '%s\0' "$f"; done \
  | tar --null -T - -cf - | tar -xf - -C "$src"
digest="$("$PY" scripts/devpack.py source-digest "$src")"
"$PY" -m pip wheel -q --disable-pip-version-check --no-deps --no-build-isolation --no-index \
  -w "$tmp/wheels" "$src" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
log "project: $(basename "$tmp"/wheels/tailproof-*.whl)"

# Each supported vLLM release (requirements/vllm-releases.txt, newest first): its sources from
# the venv (the default release) or its overlay folder.
purelib="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
releases=()
header=()
for v in $(awk '/^vllm==/ && $2 == "supported" {print substr($1, 7)}' requirements/vllm-releases.txt); do
  site="$(./scripts/vllm_env.sh "$v")"
  "$PY" scripts/devpack.py vllm-tar "${site:-$purelib}" "$v" "$tmp/vllm-$v.tar.xz" --reuse "$PACK"
  releases+=("$v")
  header+=("vllm $v=$("$PY" scripts/devpack.py vllm-digest "${site:-$purelib}" "$v")")
done

# The wheels: the version of requirements/constraints.txt; one an earlier pack holds is reused.
image="$(grep -v '^#' requirements/device/image-packages.txt | while read -r p; do norm "$p"; done)"
want=()
for name in $(grep -v -e '^#' -e '^$' "$LIST" | sed 's/[ #].*//'); do
  n="$(norm "$name")"
  if echo "$image" | grep -qx "$n"; then
    log "$name is in the machine's image (requirements/device/image-packages.txt): do not carry it"
    exit 1
  fi
  pin="$(grep -i "^${name}==" requirements/constraints.txt \
         || grep -i "^$(echo "$name" | tr '_-' '-_')==" requirements/constraints.txt || true)"
  [ -n "$pin" ] || { log "$name has no pin in requirements/constraints.txt"; exit 1; }
  ver="${pin#*==}"
  old="$(ls "$PACK"/wheels/ 2>/dev/null | grep -i "^${n}-${ver}-" || true)"
  if [ -n "$old" ]; then
    cp "$PACK/wheels/$old" "$tmp/wheels/"
  else
    want+=("$name==$ver")
  fi
done
if [ "${#want[@]}" -gt 0 ]; then
  log "fetching ${#want[@]} cp312 wheel(s): ${want[*]}"
  plat=()
  for p in manylinux1_x86_64 manylinux2014_x86_64 manylinux_2_{17..35}_x86_64; do
    plat+=(--platform "$p")
  done
  "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none "${plat[@]}" \
    -d "$tmp/wheels" "${want[@]}" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
fi

dirty=""
git diff --quiet HEAD -- . 2>/dev/null || dirty=" with uncommitted changes"
"$PY" scripts/devpack.py manifest "$tmp" "$LIMIT_MIB" \
  "built=$(date -u +%Y-%m-%dT%H:%M:%SZ)" "commit=$(git rev-parse HEAD)$dirty" \
  "project source=$digest" \
  "vllm releases=${releases[*]}" "${header[@]}" \
  "wheels=cp312 manylinux x86_64, installed with --no-index --no-deps" >/dev/null
rm -rf "$PACK"
mv "$tmp" "$PACK"
log "$(sed -n 2p "$PACK/MANIFEST.txt") in $PACK ($(ls "$PACK/wheels" | wc -l) wheels, ${releases[*]})"
