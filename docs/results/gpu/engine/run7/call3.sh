#!/usr/bin/env bash
# s11 call 3 (issue 13): the engine with this session's decode kernels and Engine::warm_up:
# test_cuda_engine (the warm-up tests included), bench at 8 x 32K with and without warm-up (full,
# K4V4, K2V2; synthetic caches), the largest batch at 32K at the default prefill step 512 (full,
# K2V2), test_cuda_eval but its passkey test; then ncu source counters of the packed decode
# kernels (docs/results/gpu/run10_decode/c3). Output: OUT/log.txt and one JSON per bench.
here=$(cd "$(dirname "$0")" && pwd)
root=$(pwd)
out=$OUT
rm -rf /tmp/vqe && mkdir -p /tmp/vqe && tar xJf "$here/gpu.txz" -C /tmp/vqe
export LD_LIBRARY_PATH=/tmp/vqe/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
for d in /usr/local/cuda/lib64 /opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib; do
  [ -e "$d/libcublas.so.13" ] && LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$d
done
export VQ_SOURCE_DIR=$root VQ_MODEL_DIR=$root/models/vq-mini-llama
V=/tmp/vqe/veloxquant
M8=/tmp/llama8b
exec > >(tee -a "$out/log.txt") 2>&1
run() {
  local label=$1 limit=$2
  shift 2
  echo "=== $label: $*"   # (to stdout: the bench JSON files start with this line)
  SECONDS=0
  timeout "$limit" "$@"
  echo "=== $label rc=$? ${SECONDS}s"
}
bench() {
  local name=$1 limit=$2
  shift 2
  run "bench $name" "$limit" "$V" bench --device cuda --model "$M8" --no-check-weights --json "$@" >"$out/$name.json"
}
cd /tmp/vqe
run test_cuda_engine 130 ./test_cuda_engine 2>&1 | grep -E "^\[  (PASSED|FAILED|  OK) |FAILED TEST|Failure|first decode step|warm" | head -40
run make_llama_shapes 60 python3 "$root/tools/make_llama_shapes.py" "$M8" --preset 8b
Q=skvq:bits_key=4:bits_value=4,skvq:bits_key=2:bits_value=2
B="--context 32768 --gen 16 --synthetic-prefill"
bench warm_8x32k 80 --methods "full,$Q" --batch 8 --prefill-step 32768 $B
bench nowarm_8x32k 80 --methods "full,$Q" --batch 8 --prefill-step 32768 $B --no-warm-up
bench fit512 150 --methods "full,skvq:bits_key=2:bits_value=2" --max-batch-fit $B
run test_cuda_eval 70 ./test_cuda_eval --gtest_filter=-*Passkey* 2>&1 | grep -E "^\[  (PASSED|FAILED|  OK) |FAILED TEST|Failure" | head -20
# call 5, on the same machine: veloxquant bench $B_FIT --methods skvq:bits_key=2:bits_value=2
# [--plan-only | --no-warm-up] and --methods full, with B_FIT = --device cuda --model /tmp/llama8b
# --no-check-weights --context 32768 --gen 16 --synthetic-prefill --max-batch-fit
