#!/usr/bin/env bash
# s13 call 3 (issues 13, 14): the batched tensor-core decode launch keeps the kernel-parameter
# reads for f16 rows only; packed rows stage their sequence's parameters in shared memory again
# (d1 and d2 measured the engine's K2V2 at 8 x 32K 5-7 % slower read in place). Decode tests and
# memcheck, then the engine: new, old (main), new again at 8 x 32K; the largest batches at 32K.
here=$(cd "$(dirname "$0")" && pwd)
root=$(pwd)
o=$OUT
export PATH=$PATH:/usr/local/cuda/bin
rm -rf /tmp/d3 && mkdir -p /tmp/d3 && tar xJf "$here/gpu.txz" -C /tmp/d3
export LD_LIBRARY_PATH=/tmp/d3/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
for d in /usr/local/cuda/lib64 /opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib; do
  [ -e "$d/libcublas.so.13" ] && LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$d
done
export VQ_SOURCE_DIR=$root VQ_MODEL_DIR=$root/models/vq-mini-llama
cd /tmp/d3
exec > >(tee -a "$o/run.txt") 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
t() {  # label, limit, command...
  local label=$1 limit=$2; shift 2
  SECONDS=0; timeout "$limit" "$@" >/tmp/d3/log_$label.txt 2>&1; local rc=$?
  echo "== $label rc=$rc ${SECONDS}s"
  grep -E "^\[(  FAILED|  PASSED)|worst|Failure|FAILED TEST|\] per op" /tmp/d3/log_$label.txt | head -24
  [ $rc -eq 0 ] || { grep -B2 -A12 "Failure" /tmp/d3/log_$label.txt | head -60 > $o/fail_$label.txt; }
}
for p in test_cuda_decode_batch; do
  [ -x ./$p ] && t $p 200 ./$p
done
SECONDS=0
timeout 150 compute-sanitizer --tool memcheck --error-exitcode 86 --print-limit 20 \
  ./test_cuda_decode_batch >/tmp/d3/san.txt 2>&1
echo "== memcheck test_cuda_decode_batch rc=$? ${SECONDS}s $(grep -E 'ERROR SUMMARY' /tmp/d3/san.txt | tail -1) $(grep -E '^\[  PASSED' /tmp/d3/san.txt)"
M8=/tmp/llama8b
timeout 60 python3 "$root/tools/make_llama_shapes.py" "$M8" --preset 8b | tail -1
bench() {  # binary (old|new), json name, limit, bench args...
  local bin=$1 name=$2 limit=$3; shift 3
  SECONDS=0
  timeout "$limit" ./veloxquant_$bin bench --device cuda --model "$M8" --no-check-weights --json "$@" \
    >"$o/${name}_$bin.json" 2>/tmp/d3/$name.err
  echo "== bench $name $bin rc=$? ${SECONDS}s"; tail -2 /tmp/d3/$name.err
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
M3="full,skvq:bits_key=4:bits_value=4,skvq:bits_key=2:bits_value=2"
bench new b8x32k 120 --methods "$M3" $B
bench old b8x32k 120 --methods "$M3" $B
bench new b8x32k_again 120 --methods "$M3" $B
L="--context 32768 --gen 16 --synthetic-prefill"
bench new k2v2_b123 200 --methods skvq:bits_key=2:bits_value=2 --batch 123 $L
bench new full_b29 150 --methods full --batch 29 $L
bench new k4v4_b82 200 --methods skvq:bits_key=4:bits_value=4 --batch 82 $L
