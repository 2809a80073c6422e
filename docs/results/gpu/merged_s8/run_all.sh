#!/usr/bin/env bash
# Session 8, last device call: every tests/cuda program of merged main (one bundle of
# scripts/gpu_engine_bundle.sh with VQ_BUNDLE_TESTS = all of them), then the engine's 1 x 32K
# real prefill (full) beside transformers' 1 x 32K on a random Llama-3-8B-shaped model.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(pwd)
out=${OUT:-$here/out}
mkdir -p "$out"
rm -rf /tmp/vqe && mkdir -p /tmp/vqe && tar xJf "$here/gpu.txz" -C /tmp/vqe
export LD_LIBRARY_PATH=/tmp/vqe/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
for d in /usr/local/cuda/lib64 /opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib; do
  [ -e "$d/libcublas.so.13" ] && LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$d
done
export VQ_SOURCE_DIR=$root VQ_MODEL_DIR=$root/models/vq-mini-llama
log=$out/tests.txt
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader >"$log"
run() {  # label, timeout, command...
  local label=$1 limit=$2
  shift 2
  echo "=== $label" >>"$log"
  SECONDS=0
  timeout "$limit" "$@" >"$out/$label.full.txt" 2>&1
  local rc=$?
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\] .* ran|FAILED TEST|cases .* failed" "$out/$label.full.txt" >>"$log"
  echo "=== $label rc=$rc ${SECONDS}s" >>"$log"
}
cd /tmp/vqe
for t in test_cuda_decode test_cuda_prefill test_cuda_caches test_cuda_skvq test_cuda_snapkv \
         test_cuda_tensor_parallel test_cuda_engine test_backend_ops_cuda; do
  run "$t" 120 ./"$t"
done
run test_cuda_eval 60 ./test_cuda_eval --gtest_filter=-*Passkey*
M8=/tmp/llama8b
SECONDS=0; timeout 60 python3 "$root/tools/make_llama_shapes.py" "$M8" --preset 8b >>"$log" 2>&1; echo "make8b rc=$? ${SECONDS}s" >>"$log"
SECONDS=0; timeout 45 ./veloxquant bench --device cuda --model "$M8" --no-check-weights --json \
  --methods full --batch 1 --context 32768 --gen 4 --prefill-step 8192 >"$out/bench_1x32k.json" 2>>"$log"
echo "bench 1x32k rc=$? ${SECONDS}s" >>"$log"
cd "$root"
SECONDS=0; timeout 60 python3 tools/bench_transformers.py "$M8" --batch 1 --context 32768 --gen 4 \
  --repeats 1 --out "$out/transformers_1x32k.json" >>"$log" 2>&1
echo "transformers 1x32k rc=$? ${SECONDS}s" >>"$log"
rm -f "$out"/*.full.txt.keep
# keep at most 8 files: the failing programs' full logs only
for f in "$out"/*.full.txt; do grep -q "rc=0 " <(grep "=== $(basename "$f" .full.txt) rc" "$log") && rm -f "$f"; done
