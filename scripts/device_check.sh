#!/usr/bin/env bash
# The GPU checks, as one script for a lent CUDA machine (run from the repo root; results go to
# $OUT, default ./out/device): the corpus on the impl adapter with CUDA KV tensors (memory store
# and a real Mooncake master on 127.0.0.1), the CUDA data-plane tests (pinned staging pool, the
# step's CUDA event ordering the sender's device-to-host copies, loads on the copy stream), and
# the store benchmarks, and Model Runner V2 end to end in the real engine.
# Not runnable on a CPU-only machine: it stops at once when torch sees no CUDA device.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out/device}"
mkdir -p "$OUT"
./scripts/bootstrap.sh
PY=.venv/bin/python
"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "no CUDA device")'
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
for store in memory mooncake; do
  .venv/bin/tailproof replay conformance/cases/*.json --against reference,impl --store "$store" \
    --device cuda --json > "$OUT/replay-impl-cuda-$store.json" || echo "divergences on $store" >&2
done
# The CUDA data path: pinned staging pool, the step's CUDA event ordering the sender's
# device-to-host copies after a still-running kernel (no host wait in wait_for_save), loads on
# the copy stream, sealed values verified on the way back. A skip here means no GPU was seen.
"$PY" -m pytest tests/impl/test_worker_side.py tests/impl/test_data_plane.py -k cuda -rs 2>&1 \
  | tee "$OUT/cuda-worker-test.txt"
if grep -q "skipped" "$OUT/cuda-worker-test.txt"; then
  echo "CUDA data-path tests were skipped on a CUDA machine" >&2
  exit 1
fi
# Model Runner V2 end to end (vLLM 0.33's default on a GPU): the real engine with the test-bed
# model on CUDA and TailproofConnector; cold / warm / store-hit / after-reset outputs against an
# engine without prefix caching (docs/impl.md, "What vLLM 0.33 hands the connector").
"$PY" scripts/device_v2_e2e.py --out "$OUT/v2-e2e.json" 2>&1 | tail -n 40 \
  | tee "$OUT/v2-e2e.log" || echo "Model Runner V2 end to end failed" >&2
"$PY" benchmarks/store_throughput.py --rounds 20 2>&1 | tee "$OUT/store-throughput.md"
