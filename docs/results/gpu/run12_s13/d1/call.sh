#!/usr/bin/env bash
# s13 call 1 (issues 13, 14): the batched decode launch reads each sequence's parameters from its
# kernel parameter (DecodeBatchArg) instead of staging them in shared memory; merged with the
# helpers' snap_decode_budget and per-layer SKVQ key lists on the device. Every GPU test program
# touched, compute-sanitizer over the batched test and the two new cache tests, then the
# engine A/B in one call: main's binary (old) against this branch's (new), --phases at 8 x 32K
# (full, skvq K4V4) and the largest batches at 32K (full 29, skvq K2V2 123: four launches of <= 32).
here=$(cd "$(dirname "$0")" && pwd)
root=$(pwd)
o=$OUT
export PATH=$PATH:/usr/local/cuda/bin
rm -rf /tmp/d1 && mkdir -p /tmp/d1 && tar xJf "$here/gpu.txz" -C /tmp/d1
export LD_LIBRARY_PATH=/tmp/d1/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
for d in /usr/local/cuda/lib64 /opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib; do
  [ -e "$d/libcublas.so.13" ] && LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$d
done
export VQ_SOURCE_DIR=$root VQ_MODEL_DIR=$root/models/vq-mini-llama
cd /tmp/d1
exec > >(tee -a "$o/run.txt") 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
t() {  # label, limit, command...
  local label=$1 limit=$2; shift 2
  SECONDS=0; timeout "$limit" "$@" >/tmp/d1/log_$label.txt 2>&1; local rc=$?
  echo "== $label rc=$rc ${SECONDS}s"
  grep -E "^\[(  FAILED|  PASSED)|worst|Failure|FAILED TEST|\] per op" /tmp/d1/log_$label.txt | head -24
  [ $rc -eq 0 ] || { grep -B2 -A12 "Failure" /tmp/d1/log_$label.txt | head -60 > $o/fail_$label.txt; }
}
for p in test_cuda_decode_batch test_cuda_decode test_cuda_engine test_cuda_caches test_cuda_skvq \
         test_backend_ops_cuda test_cuda_tensor_parallel test_cuda_eval; do
  [ -x ./$p ] && t $p 200 ./$p
done
SECONDS=0
timeout 150 compute-sanitizer --tool memcheck --error-exitcode 86 --print-limit 20 \
  ./test_cuda_decode_batch >/tmp/d1/san.txt 2>&1
echo "== memcheck test_cuda_decode_batch rc=$? ${SECONDS}s $(grep -E 'ERROR SUMMARY' /tmp/d1/san.txt | tail -1) $(grep -E '^\[  PASSED' /tmp/d1/san.txt)"
SECONDS=0
timeout 150 compute-sanitizer --tool memcheck --error-exitcode 86 --print-limit 20 \
  ./test_cuda_caches --gtest_filter='CudaCaches.SnapKVDecodeBudget*:CudaCaches.PerLayer*' >/tmp/d1/san2.txt 2>&1
echo "== memcheck test_cuda_caches new rc=$? ${SECONDS}s $(grep -E 'ERROR SUMMARY' /tmp/d1/san2.txt | tail -1) $(grep -E '^\[  PASSED' /tmp/d1/san2.txt)"
M8=/tmp/llama8b
timeout 60 python3 "$root/tools/make_llama_shapes.py" "$M8" --preset 8b | tail -1
bench() {  # binary (old|new), json name, limit, bench args...
  local bin=$1 name=$2 limit=$3; shift 3
  SECONDS=0
  timeout "$limit" ./veloxquant_$bin bench --device cuda --model "$M8" --no-check-weights --json "$@" \
    >"$o/${name}_$bin.json" 2>/tmp/d1/$name.err
  echo "== bench $name $bin rc=$? ${SECONDS}s"; tail -2 /tmp/d1/$name.err
  python3 - "$o/${name}_$bin.json" <<'PY'
import json, sys
try:
    j = json.load(open(sys.argv[1]))
except Exception as e:
    print("  (no JSON:", e, ")"); sys.exit(0)
for m in j["methods"]:
    r = m.get("run", {})
    print("  %-40s batch %3d decode %7.1f (steady %7.1f) tok/s %5.1f%% (steady %5.1f%%) peak %5.1f GiB" % (
        m["method"], m["batch"], r.get("decode_tokens_per_s", 0), r.get("steady_decode_tokens_per_s", 0),
        r.get("decode_pct_of_bound", 0), r.get("steady_decode_pct_of_bound", 0),
        r.get("peak_device_bytes", 0) / 2**30))
    for p in m.get("phases", []):
        if p["decode"] and p["phase"] in ("attention", "cache update"):
            print("    %-26s device %7.3f ms host %7.3f ms" % (p["phase"], p["gpu_seconds"] / p["steps"] * 1e3,
                  p["host_seconds"] / p["steps"] * 1e3))
PY
}
B="--batch 8 --context 32768 --gen 16 --prefill-step 32768 --synthetic-prefill"
for v in old new; do
  bench $v phases_8x32k 120 --methods "full,skvq:bits_key=4:bits_value=4,skvq:bits_key=2:bits_value=2" $B --phases
done
for v in new old; do
  bench $v b8x32k 120 --methods "full,skvq:bits_key=4:bits_value=4,skvq:bits_key=2:bits_value=2" $B
done
L="--context 32768 --gen 16 --synthetic-prefill"
for v in old new; do
  bench $v full_b29 150 --methods full --batch 29 $L
  bench $v k2v2_b123 200 --methods skvq:bits_key=2:bits_value=2 --batch 123 $L
done
# the two options new on the device this session, at 8 x 32K (new binary only)
bench new newopts_8x32k 150 --methods "skvq:bits_value=2:layer_bits_key=4/4/4/4/2/2/2/2/2/2/2/2/2/2/2/2/2/2/2/2/2/2/2/2/2/2/2/2/2/2/2/2,snapkv:budget=1024:scoring=query:decode_budget=1016:decode_every=8,snapkv:budget=1024:scoring=query,snapkv+skvq:budget=1024:scoring=query:bits_key=4:bits_value=4" $B --phases
