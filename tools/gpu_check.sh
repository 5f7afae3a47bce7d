#!/usr/bin/env bash
# Every GPU check in one go, on a machine with a CUDA device (about 2 minutes on an H200):
# the facts the GPU path relies on (tools/gpu_diagnose.py), bench_gpu at 4k and 16k tokens with
# the operator ratios, where a warm request's time goes (tools/gpu_breakdown.py), then every test
# marked gpu. Each step writes its log and JSON to $OUT
# (default /tmp/kvstore-gpu); a step that fails or runs past its limit does not stop the next,
# and the script exits 1 naming the failed steps.
# DIAGNOSE_S, BENCH_S, BREAKDOWN_S, PYTEST_S set each step's limit in seconds (0 skips it).
#
#   bash tools/gpu_check.sh            # from the repository root
#
# The GPU machine has torch, transformers, grpcio, protobuf, msgpack, xxhash, rich, pyyaml and
# prometheus-client but no Ray and no Redis, which none of these steps import. Where its grpcio
# is older than the generated code needs, or cryptography is missing, wheels put in .whl/ (not
# committed; the README's "Running on a GPU" says which) are installed into /tmp/site first.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvstore-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 COLUMNS=160 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}

if ! "$PY" -c "import kvstore.protos.kvstore_pb2, kvstore.protos.kvstore_pb2_grpc, cryptography" 2>/dev/null; then
  if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && export PYTHONPATH="/tmp/site:$PYTHONPATH"
  fi
fi
# Store-node arenas live in /dev/shm: bench_gpu's node needs ~5 GiB of it.
free_gib=$(df -BG --output=avail /dev/shm | tail -1 | tr -dc 0-9)
if [ "${free_gib:-0}" -lt 16 ] && [ "$(id -u)" = 0 ]; then
  mount -o remount,size=32G /dev/shm || true
fi
{ nvidia-smi -L; df -h /dev/shm; "$PY" -c "import torch, transformers, grpc, google.protobuf as p;
print('torch', torch.__version__, 'transformers', transformers.__version__, 'grpcio',
      grpc.__version__, 'protobuf', p.__version__)"; } 2>&1 | tee "$OUT/machine.log"

step() {  # step NAME LIMIT_S COMMAND...: run it, keep its output in $OUT/NAME.log
  local name=$1 limit=$2 start rc
  shift 2
  if [ "$limit" = 0 ]; then echo "=== $name: skipped (limit 0)"; return; fi
  echo "=== $name (at most ${limit}s)"
  start=$(date +%s)
  timeout -k 10 "$limit" "$@" > >(tee "$OUT/$name.log") 2>&1
  rc=$?
  echo "=== $name: exit $rc after $(( $(date +%s) - start ))s"
  [ "$rc" = 0 ] || failed+=("$name (exit $rc)")
}
failed=()

step diagnose "${DIAGNOSE_S:-60}" "$PY" -m tools.gpu_diagnose --json "$OUT/diagnose.json"
step bench_gpu "${BENCH_S:-200}" "$PY" -m benchmarks.bench_gpu --json "$OUT/bench_gpu.json"
step breakdown "${BREAKDOWN_S:-120}" "$PY" -m tools.gpu_breakdown --json "$OUT/breakdown.json" \
  ${BREAKDOWN_ARGS:-}
step pytest_gpu "${PYTEST_S:-120}" "$PY" -m pytest -p no:cacheprovider -q -m gpu -rfE \
  tests/ops/test_operators_gpu.py tests/workers/engine/test_engine_gpu.py tests/client/test_device_reads.py \
  tests/client/test_device_checksum.py \
  tests/client/test_cluster_store_device.py tests/workers/engine/test_engine_nodes.py \
  tests/client/test_layered_copies.py tests/workers/model/test_layer_fed_cache.py
if [ "${#failed[@]}" -gt 0 ]; then
  echo "gpu_check: failed: ${failed[*]} (logs in $OUT)" >&2
  exit 1
fi
echo "gpu_check: every step passed (logs and JSON in $OUT)"
