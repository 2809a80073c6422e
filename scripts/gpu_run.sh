#!/usr/bin/env bash
# On a GPU host, from a checkout holding a bundle of scripts/gpu_bundle.sh: runs every GPU test
# program, then the decode benchmark with PyTorch SDPA beside it (tools/bench_sdpa.py) and the
# prefill benchmark with SDPA's causal prefill (bench/cuda_prefill_sdpa.py), all in one call so
# the ratios share one machine state, and FlashInfer's paged decode as a peer
# (tools/bench_flashinfer.py, when the bundle carries its wheels); then a compute-sanitizer pass (memcheck and racecheck) over
# the GPU test programs, filtered to their small cases (about 4 minutes on an H200 at most: each
# program is cut off at VQ_SANITIZE_TIMEOUT seconds, default 40). Logs go to OUT (default:
# DIR/out); a summary to stdout. Exits non-zero when a test program fails or the sanitizer reports
# an error (or cannot run: VQ_SANITIZE=skip leaves the pass out, e.g. on a runtime that refuses
# it).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
out=${OUT:-$here/out}
rm -rf /tmp/vq-gpu  # a warm machine keeps the last call's programs: run only this bundle's
mkdir -p "$out" /tmp/vq-gpu
tar xJf "$here/gpu.txz" -C /tmp/vq-gpu
export LD_LIBRARY_PATH=/tmp/vq-gpu/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# libcublas.so.13 (the CUDA engine's products, linked dynamically): the toolkit's, else PyTorch's
for d in /usr/local/cuda/lib64 /opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib; do
  [ -e "$d/libcublas.so.13" ] && LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$d
done
# the engine test reads the shipped model and the golden prompts from the checkout
export VQ_SOURCE_DIR=$root VQ_MODEL_DIR=$root/models/vq-mini-llama
# a script: the bundle's copy (gpu_bundle.sh packs the ones of its build) if any, else the checkout's
script() { if [ -f "$here/$(basename "$1")" ]; then echo "$here/$(basename "$1")"; else echo "$root/$1"; fi; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
cd /tmp/vq-gpu
status=0
# a peers bundle (VQ_BUNDLE=peers in gpu_bundle.sh) holds the decode benchmark and the decode
# tests alone: no prefill benchmark, no sanitizer pass
full=1
[ -x ./cuda_prefill_attention ] || full=0
for t in test_cuda_decode test_cuda_skvq test_cuda_snapkv test_cuda_caches test_cuda_prefill \
  test_backend_ops_cuda test_cuda_engine; do
  [ -x "./$t" ] || continue
  SECONDS=0
  timeout 300 "./$t" >"$out/$t.txt" 2>&1
  rc=$?
  echo "$t rc=$rc ${SECONDS}s"
  [ "$rc" -eq 0 ] || status=1
  grep -E "^\[(  FAILED|  PASSED|  SKIPPED)|worst|Failure|exception" "$out/$t.txt" | head -20
done
# an engine bundle (VQ_BUNDLE=engine) holds test_cuda_engine alone: no benchmark, no sanitizer
if [ ! -x ./cuda_decode_attention ]; then
  echo "engine bundle: benchmarks and sanitizer left out; status=$status"
  exit $status
fi
timeout 300 ./cuda_decode_attention --csv "$out/bench.csv" --repeats 20 >"$out/decode.txt" 2>&1
echo "decode bench rc=$?"
(cd "$root" && PYTHONUNBUFFERED=1 timeout 300 python3 "$(script tools/bench_sdpa.py)" \
  "$out/bench.csv" --repeats 20 >"$out/sdpa.txt" 2>&1)
echo "sdpa rc=$?"
sed -n '/^## Targets/,$p' "$out/sdpa.txt"
# FlashInfer's paged decode (bf16, fp8 e4m3) as peers in the same call: its wheels (carried in
# the bundle's whl/ by gpu_bundle.sh) installed into /tmp, JIT kernels built once before timing
if ls "$here"/whl/*.whl >/dev/null 2>&1 && [ "${VQ_PEERS:-on}" != skip ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/vq-site "$here"/whl/*.whl >"$out/flashinfer.txt" 2>&1
  (cd "$root" && PYTHONPATH=/tmp/vq-site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 \
    FLASHINFER_WORKSPACE_BASE=/tmp/vq-fi FLASHINFER_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 \
    timeout 420 python3 "$(script tools/bench_flashinfer.py)" "$out/bench.csv" --repeats 20 \
    >>"$out/flashinfer.txt" 2>&1)
  echo "flashinfer rc=$?"
  grep -E "^JIT|not importable" "$out/flashinfer.txt"
  sed -n '/^## Peer targets/,$p' "$out/flashinfer.txt"
else
  echo "flashinfer: no wheels in $here/whl (or VQ_PEERS=skip): no peer rows"
fi
if [ "$full" = 0 ]; then
  echo "peers/decode bundle: the other tests, prefill and sanitizer left out; status=$status"
  exit $status
fi
timeout 300 ./cuda_prefill_attention --repeats 5 >"$out/prefill.txt" 2>&1
echo "prefill bench rc=$?"
(cd "$root" && PYTHONUNBUFFERED=1 timeout 120 python3 "$(script bench/cuda_prefill_sdpa.py)" \
  --repeats 5 >"$out/prefill_sdpa.txt" 2>&1)
echo "prefill sdpa rc=$?"

# ---- compute-sanitizer: memcheck over the small cases of every GPU test program, racecheck over
# those of the programs whose kernels share memory between threads (decode, flush, SnapKV,
# prefill). A case list per program keeps the pass short (the sanitizer slows kernels 10-100x).
if [ "${VQ_SANITIZE:-on}" = skip ]; then
  echo "sanitizer: skipped (VQ_SANITIZE=skip)"
  exit $status
fi
cs=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer \
  /usr/local/cuda/compute-sanitizer/compute-sanitizer 2>/dev/null | head -1)
if [ -z "$cs" ]; then
  echo "sanitizer: FAILED: compute-sanitizer not found (VQ_SANITIZE=skip to leave it out)"
  exit 1
fi
limit=${VQ_SANITIZE_TIMEOUT:-40}
memcheck=(
  "test_cuda_decode CudaDecode.PlanOnceRunPerLayer:CudaDecode.RefusesUnsupportedShapes"
  "test_cuda_skvq CudaSkvq.QuantizeRowsTiesBitIdentical:CudaSkvq.RefusesMismatchedFormat"
  "test_cuda_snapkv CudaSnapkv.NonFiniteKeysGiveNanScores"
  "test_cuda_caches CudaCaches.SnapKVWorkedExample:CudaCaches.SkvqWorkedExampleAndResidentBytes:CudaCaches.ErrorsMatchCpuAndChangeNothing:CudaCaches.StreamingMatchesCpu"
  "test_cuda_prefill CudaPrefill.RefusesUnsupported"
  "test_backend_ops_cuda BackendOpsCuda.DecodeAttention:BackendOpsCuda.SkvqChannelPerms:BackendOpsCuda.SnapPool:BackendOpsCuda.SnapSelect:BackendOpsCuda.GatherRows"
  "test_backend_ops_cuda BackendOpsCuda.PrefillAttention:BackendOpsCuda.SkvqQuantizeRows:BackendOpsCuda.SnapScores"
)
racecheck=(
  "test_cuda_decode CudaDecode.PlanOnceRunPerLayer"
  "test_cuda_skvq CudaSkvq.QuantizeRowsTiesBitIdentical"
  "test_cuda_prefill CudaPrefill.RefusesUnsupported"
  "test_backend_ops_cuda BackendOpsCuda.SkvqChannelPerms:BackendOpsCuda.SnapPool:BackendOpsCuda.GatherRows"
  "test_backend_ops_cuda BackendOpsCuda.DecodeAttention"
)
# The op harness's reduced table (tests/ops_harness/harness.h small_sweep) under the sanitizer.
export VQ_HARNESS=small
sanitize() {  # tool, then "program filter" entries
  local tool=$1 entry t filter log rc i=0
  shift
  for entry in "$@"; do
    t=${entry%% *}
    filter=${entry#* }
    i=$((i + 1))
    log="$out/sanitize_${tool}_${i}_$t.txt"
    SECONDS=0
    timeout "$limit" "$cs" --tool "$tool" --error-exitcode 86 --print-limit 20 \
      "./$t" --gtest_filter="$filter" >"$log" 2>&1
    rc=$?
    echo "sanitizer $tool $t rc=$rc ${SECONDS}s $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" |
      tail -1 | sed 's/^=* *//'); $(grep -E '^\[  PASSED  \]' "$log" | tail -1)"
    if [ "$rc" -ne 0 ]; then
      status=1
      [ "$rc" -eq 124 ] && echo "  cut off after ${limit}s: narrow its case list"
      grep -E "^========= (Invalid|Error|Race|Program hit|  )|FAILED" "$log" | head -12
    fi
  done
}
sanitize memcheck "${memcheck[@]}"
sanitize racecheck "${racecheck[@]}"
echo "sanitizer pass done; status=$status"
exit $status
