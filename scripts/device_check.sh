#!/usr/bin/env bash
# The GPU check, for a lent CUDA machine where nothing can be fetched. Run there from the repo
# root with the pack carried (scripts/device_pack.sh builds .devpack here):
#   scripts/device_check.sh            results under $OUT (default out/device)
# It installs the pack with --no-index into $DEVICE_SITE beside the machine's own Python and
# torch (python3, or DEVICE_PYTHON), then runs, most valuable first, each step under its own
# timeout and all of them within DEVICE_BUDGET_S (default 450 s):
#   1. the CUDA data-plane tests, per release: pinned staging, the step's CUDA event ordering
#      the sender's device-to-host copies, loads on the copy stream, sealed values verified;
#   2. the corpus on the impl adapter with CUDA KV tensors on the memory store, per release;
#   3. store put/get throughput against torch's pinned copies, values 64 KiB to 64 MiB;
#   4. the real engine on CUDA with the oracle's four passes, per release (Model Runner V2; on
#      0.34 the extensible KV cache), as far as it goes without vLLM's compiled ops.
# A step that cannot run says why in one line and the rest go on. Without a CUDA device (the
# dry run, `make device-dryrun`) each step says so and runs its CPU stand-in instead, which
# proves the set-up and the commands (step 4's: --plan; DEVICE_STANDIN_BED=1: the whole CPU
# test bed, minutes per release). DEVICE_STEPS="1 4" runs only those steps (a second try).
# $OUT gets at most 8 files, summary.txt first (one line per step, written as it goes).
# Exit status: 0 when no step failed (a step that cannot run is not a failure), 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$SECONDS
OUT="${OUT:-out/device}"
PY="${DEVICE_PYTHON:-python3}"
PACK="${DEVPACK:-.devpack}"
SITE="${DEVICE_SITE:-/tmp/tailproof-device}"
BUDGET="${DEVICE_BUDGET_S:-450}"
STEPS="${DEVICE_STEPS:-1 2 3 4}"
STANDIN_CASES="${DEVICE_STANDIN_CASES:-12}"
export PYTHONUNBUFFERED=1
# The checkout's own tailproof/ folder must not shadow the installed package (the project maps
# tailproof.<part> onto top-level folders): no process puts the working directory on sys.path.
export PYTHONSAFEPATH=1
# No Mooncake runs here: the tests need not move into a private network namespace.
export TAILPROOF_NETNS=0
# vLLM logs to stdout by default: to stderr, so that a command's JSON report stays clean.
export VLLM_LOGGING_STREAM=ext://sys.stderr
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
SETUP="$OUT/setup.log"
: > "$SUMMARY"
: > "$SETUP"
RES="$SITE/results"

say() { echo "$*" | tee -a "$SUMMARY"; }
left() { echo $((BUDGET - (SECONDS - T0))); }
# cap WANT: the seconds a step may take, WANT or what is left of the budget
cap() { local l; l="$(left)"; [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
want_step() { [[ " $STEPS " == *" $1 "* ]]; }
last_line() { grep -v '^\s*$' "$1" 2>/dev/null | tail -n 1 | cut -c1-300; }
timed_out() { [ "$1" = 124 ] || [ "$1" = 137 ]; }

# --------------------------------------------------------------------- set-up
fail_setup() {
  say "setup: FAILED: $*"
  say "done in $((SECONDS - T0)) s: nothing ran (see setup.log)"
  exit 1
}
{
  echo "== $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -n), $(nproc) CPUs"
  nvidia-smi 2>&1 || echo "(nvidia-smi: not available)"
  echo "== python: $(command -v "$PY") $("$PY" --version 2>&1)"
  echo "== the pack ($PACK)"
} >> "$SETUP"
"$PY" scripts/devpack.py verify "$PACK" >> "$SETUP" 2>&1 \
  || fail_setup "$(last_line "$SETUP")"
releases="$(sed -n 's/^vllm releases: //p' "$PACK/MANIFEST.txt")"
default="${releases%% *}"
rm -rf "$SITE"
mkdir -p "$SITE/common" "$RES"
echo "== pip install --no-index --no-deps --target $SITE/common" >> "$SETUP"
timeout -k 10 "$(cap 150)" "$PY" -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --disable-pip-version-check --target "$SITE/common" "$PACK"/wheels/*.whl \
    >> "$SETUP" 2>&1 || fail_setup "pip install from the pack: $(last_line "$SETUP")"
# The project: the pack's wheel, unless this tree's sources differ from what it was built from
# (a pack older than the tree); then a wheel of this tree, built offline.
built="$(sed -n 's/^project source: //p' "$PACK/MANIFEST.txt")"
here="$("$PY" scripts/devpack.py source-digest .)"
project="the pack's ($(sed -n 's/^commit: //p' "$PACK/MANIFEST.txt"))"
if [ "$built" != "$here" ]; then
  echo "== project sources differ from the pack's: building this tree's wheel" >> "$SETUP"
  { "$PY" -m pip wheel -q --no-deps --no-build-isolation --no-index -w "$SITE/wheel" . \
    && "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade \
         --target "$SITE/common" "$SITE"/wheel/tailproof-*.whl; } >> "$SETUP" 2>&1 \
    || fail_setup "the tree differs from the pack's project and its wheel did not build: $(last_line "$SETUP")"
  project="this tree's (newer than the pack's: re-run scripts/device_pack.sh)"
fi
for v in $releases; do
  mkdir -p "$SITE/vllm-$v"
  "$PY" scripts/devpack.py unpack "$PACK/vllm-$v.tar.xz" "$SITE/vllm-$v" >> "$SETUP" 2>&1 \
    || fail_setup "unpacking vllm $v: $(last_line "$SETUP")"
done
# Byte-compile once, in parallel, rather than in every process that imports vLLM.
timeout -k 10 "$(cap 120)" "$PY" -m compileall -q -j 0 "$SITE" >> "$SETUP" 2>&1
pypath() { echo "$SITE/vllm-$1:$SITE/common"; }
echo "== importing torch, vLLM $default and the connector" >> "$SETUP"
PYTHONPATH="$(pypath "$default")" timeout -k 10 "$(cap 120)" "$PY" -c '
import sys, torch, vllm, tailproof.impl.connector
cuda = torch.cuda.is_available()
dev = torch.cuda.get_device_name(0) if cuda else "none"
print("FACTS", int(cuda), f"python {sys.version.split()[0]}, torch {torch.__version__}, "
      f"CUDA device: {dev}")' >> "$SETUP" 2>&1 \
  || fail_setup "importing torch, vLLM $default and the connector: $(last_line "$SETUP")"
facts="$(sed -n 's/^FACTS //p' "$SETUP" | tail -n 1)"
CUDA="${facts%% *}"
say "tailproof GPU check, $(date -u +%Y-%m-%dT%H:%M:%SZ): ${facts#* }; vLLM $releases; project: $project"
say "setup: ok ($((SECONDS - T0)) s)"
NOCUDA="no CUDA device (torch $("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null) sees none)"

# --------------------------------------------------------------------- 1. CUDA data plane
if want_step 1; then
  log="$OUT/step1-cuda-tests.log"
  : > "$log"
  # per release: the tests' simulated runner builds vLLM's own layer objects
  for v in $releases; do
    name="step 1 (CUDA data-plane tests, vLLM $v)"
    t="$(cap 100)"
    if [ "$t" -lt 20 ]; then
      say "$name: cannot run: the check's $BUDGET s are spent"
      continue
    fi
    part="$RES/step1-$v.log"
    PYTHONPATH="$(pypath "$v")" timeout -k 10 "$t" "$PY" -m pytest \
      tests/impl/test_data_plane.py tests/impl/test_worker_side.py -k cuda -v -rs \
      -p no:cacheprovider > "$part" 2>&1
    rc=$?
    { echo "== vLLM $v"; cat "$part"; } >> "$log"
    res="$(grep -E '^=+ .*(passed|failed|skipped|error).* in [0-9.]+s' "$part" | tail -n 1 \
           | tr -d '=' | sed 's/^ *//; s/ *$//')"
    first="$(grep -m1 -E '^(FAILED|ERROR) ' "$part" | cut -c1-200)"
    if timed_out "$rc"; then
      say "$name: FAILED: timed out after $t s"
    elif [ "$CUDA" = 1 ] && [ "$rc" = 0 ] && [[ "$res" == *passed* ]] && [[ "$res" != *skipped* ]]; then
      say "$name: ok: $res"
    elif [ "$CUDA" = 1 ]; then
      say "$name: FAILED: ${res:-$(last_line "$part")}${first:+; first: $first}"
    elif [ "$rc" = 0 ] && [[ "$res" == *skipped* ]] && [[ "$res" != *passed* ]]; then
      why="$(grep -m1 '^SKIPPED' "$part" | sed 's/^SKIPPED \[[0-9]*\] //' | cut -c1-160)"
      say "$name: cannot run: $NOCUDA; collected and skipped: $res ($why)"
    else
      say "$name: FAILED: ${res:-$(last_line "$part")}${first:+; first: $first}"
    fi
  done
fi

# --------------------------------------------------------------------- 2. corpus, CUDA KV
if want_step 2; then
  log="$OUT/step2-replay.log"
  : > "$log"
  merged=()
  if [ "$CUDA" = 1 ]; then
    dev=cuda
    cases=(conformance/cases/*.json)
  else
    dev=cpu
    mapfile -t cases < <(ls conformance/cases/*.json | head -n "$STANDIN_CASES")
  fi
  for v in $releases; do
    name="step 2 (corpus on the impl adapter, $dev KV, memory store, vLLM $v)"
    t="$(cap 150)"
    if [ "$t" -lt 20 ]; then
      say "$name: cannot run: the check's $BUDGET s are spent"
      continue
    fi
    json="$RES/replay-$v.json"
    echo "== vLLM $v: replay of ${#cases[@]} cases --device $dev" >> "$log"
    PYTHONPATH="$(pypath "$v")" timeout -k 10 "$t" "$PY" -m tailproof replay "${cases[@]}" \
      --against reference,impl --store memory --device "$dev" --json > "$json" 2>> "$log"
    rc=$?
    merged+=("$v=$json")
    figures="$("$PY" -c '
import json, sys
r = json.load(open(sys.argv[1]))
c, o, d, s = r["cases"], r["ops"], len(r["divergences"]), r["seconds"]
print(f"{c} cases, {o} ops, {d} divergences, {s:.0f} s")' "$json" 2>/dev/null)"
    stand=""
    [ "$CUDA" = 1 ] || stand="cannot run: $NOCUDA; CPU stand-in (${#cases[@]} cases): "
    if timed_out "$rc"; then
      say "$name: ${stand}FAILED: timed out after $t s"
    elif [ "$rc" = 0 ]; then
      say "$name: ${stand}ok: $figures"
    elif [ "$rc" = 2 ] && grep -q "outside the supported range" "$log"; then
      say "$name: cannot run: $(grep "outside the supported range" "$log" | tail -n 1 | cut -c1-240)"
    else
      say "$name: ${stand}FAILED: ${figures:-$(last_line "$log")}"
    fi
  done
  [ "${#merged[@]}" -gt 0 ] && "$PY" scripts/devpack.py merge "$OUT/step2-replay.json" "${merged[@]}"
fi

# --------------------------------------------------------------------- 3. store throughput
if want_step 3; then
  name="step 3 (store put/get against torch's pinned copies, 64 KiB-64 MiB values)"
  log="$OUT/step3-throughput.md"
  t="$(cap 120)"
  if [ "$CUDA" = 1 ]; then
    args=(--device cuda --rounds 10)
    stand=""
  else
    args=(--device cpu --rounds 1 --total-mib 8 --sizes 64K,1M)
    stand="cannot run: $NOCUDA; CPU stand-in (8 MiB, 1 round): "
  fi
  if [ "$t" -lt 20 ]; then
    say "$name: cannot run: the check's $BUDGET s are spent"
  else
    PYTHONPATH="$(pypath "$default")" timeout -k 10 "$t" "$PY" \
      benchmarks/store_device_throughput.py "${args[@]}" > "$log" 2>&1
    rc=$?
    # median ratio to the peer, put / get, per value size
    ratios="$(awk -F'|' '$3 ~ /put|get/ { split($6, r, "/"); gsub(/ /, "", $2); gsub(/ /, "", r[2]);
               v[$2] = v[$2] (v[$2] == "" ? "" : "/") r[2]; if (!(($2) in o)) { o[$2] = ++n; k[n] = $2 } }
               END { for (i = 1; i <= n; i++) printf "%s%s %s", (i > 1 ? ", " : ""), k[i], v[k[i]] }' "$log")"
    if timed_out "$rc"; then
      say "$name: ${stand}FAILED: timed out after $t s"
    elif [ "$rc" = 0 ]; then
      say "$name: ${stand}ok: median share of the peer's bandwidth, put/get: $ratios"
    else
      say "$name: ${stand}FAILED: $(last_line "$log")"
    fi
  fi
fi

# --------------------------------------------------------------------- 4. the real engine
if want_step 4; then
  log="$OUT/step4-realengine.log"
  : > "$log"
  merged=()
  if [ "$CUDA" = 1 ]; then
    mode=()
    stand=""
  elif [ "${DEVICE_STANDIN_BED:-0}" = 1 ]; then
    mode=(--cpu)
    stand="cannot run: $NOCUDA; stand-in (--cpu: the CPU test bed's four passes): "
  else
    mode=(--plan)
    stand="cannot run: $NOCUDA; stand-in (--plan: imports and engine arguments): "
  fi
  todo="$(echo $releases | wc -w)"
  for v in $releases; do
    name="step 4 (real engine on CUDA, the oracle's four passes, vLLM $v)"
    # the last step: each release gets at most an even share of what is left
    t="$(cap $((200 * todo < $(left) ? 200 : $(left) / todo)))"
    todo=$((todo - 1))
    if [ "$t" -lt 30 ]; then
      say "$name: cannot run: the check's $BUDGET s are spent"
      continue
    fi
    json="$RES/e2e-$v.json"
    echo "== vLLM $v ${mode[*]}" >> "$log"
    PYTHONPATH="$(pypath "$v")" timeout -k 10 "$t" "$PY" scripts/device_v2_e2e.py \
      --out "$json" "${mode[@]}" >> "$log" 2>&1
    rc=$?
    merged+=("$v=$json")
    verdict="$(grep -E "^vLLM $v .*: (ok|FAILED)" "$log" | tail -n 1 | sed "s/^vLLM $v //")"
    if timed_out "$rc"; then
      say "$name: ${stand}FAILED: timed out after $t s"
    elif [ "$rc" = 0 ]; then
      say "$name: ${stand}ok: $verdict"
    else
      say "$name: ${stand}FAILED: ${verdict:-$(last_line "$log")}"
    fi
  done
  [ "${#merged[@]}" -gt 0 ] && "$PY" scripts/devpack.py merge "$OUT/step4-realengine.json" "${merged[@]}"
fi

status() { grep -c -E "^step [0-9] \([^)]*\): $1" "$SUMMARY"; }
failed="$(grep -c ': FAILED' "$SUMMARY")"
say "done in $((SECONDS - T0)) s: $(status ok) ok, $failed failed, $(status 'cannot run') cannot run"
[ "$failed" = 0 ]
