#!/usr/bin/env bash
# The GPU check's dry run on a machine without a GPU (make device-dryrun; .ci/run runs it after
# make test): build the pack (scripts/device_pack.sh), build a Python 3.12 venv holding only
# packages the lent machine's image holds (scripts/device_dryrun_venv.sh), then run
# scripts/device_check.sh with that Python exactly as the lent machine would: the pack installed
# with --no-index, each CUDA step saying it cannot run and its CPU stand-in run instead.
# Set-up fetches from the registry like the bootstrap; the check itself fetches nothing.
# Fails unless every step reported, none failed, and each stand-in passed.
# Results: out/device-dryrun/ (the files a lent machine would send back).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out/device-dryrun}"
./scripts/device_pack.sh
VPY="$(./scripts/device_dryrun_venv.sh)"
site="$(mktemp -d)"
trap 'rm -rf "$site"' EXIT
rm -rf "$OUT"
rc=0
# This machine is slower than the lent one (2 shared cores): a longer budget, same steps.
OUT="$OUT" DEVICE_PYTHON="$VPY" DEVICE_SITE="$site" DEVICE_BUDGET_S="${DEVICE_BUDGET_S:-1200}" \
  ./scripts/device_check.sh || rc=$?

S="$OUT/summary.txt"
problems=()
[ "$rc" = 0 ] || problems+=("device_check.sh exited $rc")
grep -q '^setup: ok' "$S" || problems+=("the set-up did not finish")
cuda=false
grep -q '^tailproof GPU check.*CUDA device: none' "$S" || cuda=true
expect() {  # expect STEP PATTERN WHAT: every line of STEP matches PATTERN
  local lines
  lines="$(grep "^step $1 " "$S" || true)"
  if [ -z "$lines" ]; then
    problems+=("step $1 did not report")
  elif echo "$lines" | grep -v -q -E "$2"; then
    problems+=("step $1: $3")
  fi
}
releases="$(sed -n 's/^vllm releases: //p' .devpack/MANIFEST.txt)"
if $cuda; then  # a machine with a GPU runs the real steps: each must pass
  for n in 1 3 4; do expect "$n" '\): ok' "not ok"; done
  expect 2 '\): ok|outside the supported range' "not ok"
else
  expect 1 'cannot run: no CUDA device.*collected and skipped' "the CUDA tests were not collected"
  # step 2: the stand-in passes, or the impl adapter refuses a release it does not support yet
  expect 2 'CPU stand-in \([0-9]+ cases\): ok|outside the supported range' "a stand-in failed"
  grep -q '^step 2 .*CPU stand-in ([0-9]* cases): ok' "$S" \
    || problems+=("step 2: no release's corpus stand-in ran")
  expect 3 'cannot run: no CUDA device.*CPU stand-in .*: ok' "the throughput stand-in failed"
  expect 4 'cannot run: no CUDA device.*stand-in \(--(plan|cpu).*\): ok' "a stand-in failed"
fi
for v in $releases; do
  grep -q "^step 4 .*vLLM $v)" "$S" || problems+=("step 4 did not report vLLM $v")
done
if [ "${#problems[@]}" -gt 0 ]; then
  printf 'device dry run: FAILED: %s\n' "${problems[@]}" >&2
  exit 1
fi
echo "device dry run: ok ($(tail -n 1 "$S")); results in $OUT" >&2
