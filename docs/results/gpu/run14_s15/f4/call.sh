#!/usr/bin/env bash
# s15 call f4 (issue 13): main at f6ddec3 (everything of this session: f1's key codes, the
# RMSNorm change, helper 43's snapkv+skvq store changes, kv::move_rows_down for the streaming and
# SKVQ tails). The cache, SKVQ, SnapKV and engine GPU tests, memcheck over the cache test's
# streaming, SKVQ and snapkv+skvq cases, then the engine's store calls per decode step for
# streaming (window 512) and snapkv+skvq over 400 steps at 8 x 32K.
here=$(cd "$(dirname "$0")" && pwd)
root=$(pwd)
o=$OUT
export PATH=$PATH:/usr/local/cuda/bin
w=/tmp/f4
rm -rf $w && mkdir -p $w && tar xJf "$here/f4.txz" -C $w
export LD_LIBRARY_PATH=$w/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
for d in /usr/local/cuda/lib64 /opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib; do
  [ -e "$d/libcublas.so.13" ] && LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$d
done
export VQ_SOURCE_DIR=$root VQ_MODEL_DIR=$root/models/vq-mini-llama
cd $w
exec > >(tee -a "$o/run.txt") 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
t() {
  local label=$1 limit=$2; shift 2
  SECONDS=0; timeout "$limit" "$@" >$w/log_$label.txt 2>&1; local rc=$?
  echo "== $label rc=$rc ${SECONDS}s"
  grep -E "^\[(  FAILED|  PASSED)|worst|FAILED TEST|tests ran" $w/log_$label.txt | head -14
  [ $rc -eq 0 ] || grep -B3 -A15 "Failure" $w/log_$label.txt | head -60
}
t caches 150 ./test_cuda_caches
t skvq 90 ./test_cuda_skvq
t snapkv 90 ./test_cuda_snapkv
t engine 240 ./test_cuda_engine
SECONDS=0
timeout 200 compute-sanitizer --tool memcheck --error-exitcode 86 --print-limit 20 ./test_cuda_caches \
  --gtest_filter='CudaCaches.StreamingMatchesCpu:CudaCaches.SkvqMatchesCpu:CudaCaches.SnapkvSkvqMatchesCpu' >$w/san.txt 2>&1
echo "== memcheck rc=$? ${SECONDS}s $(grep -E 'ERROR SUMMARY' $w/san.txt | tail -1) $(grep -E '^\[  PASSED' $w/san.txt)"
M8=/tmp/llama8b
timeout 60 python3 "$root/tools/make_llama_shapes.py" "$M8" --preset 8b | tail -1
for m in streaming "snapkv+skvq:budget=1024:bits_key=4:bits_value=4"; do
  SECONDS=0
  timeout 150 ./veloxquant bench --device cuda --model "$M8" --no-check-weights --phases --methods "$m" \
    --batch 8 --context 32768 --gen 400 --prefill-step 32768 --synthetic-prefill --json >$w/e.json 2>$w/e.err
  echo "== engine $m gen 400 rc=$? ${SECONDS}s"; tail -2 $w/e.err
  python3 - $w/e.json <<'PY'
import json, sys
try: j = json.load(open(sys.argv[1]))
except Exception as e: print("no JSON", e); sys.exit(0)
for m in j["methods"]:
    r = m.get("run", {})
    print("  %-48s decode %7.1f steady %7.1f tok/s (%.1f%% of bound)" % (m["method"], r.get("decode_tokens_per_s", 0), r.get("steady_decode_tokens_per_s", 0), r.get("steady_decode_pct_of_bound", 0)))
    for p in m.get("phases", []):
        if p["decode"] and p["phase"] in ("cache update", "attention"):
            n = p["steps"]
            print("      %-14s %d steps: syncs %d mallocs %d frees %d in all" % (p["phase"], n, p.get("syncs", -1), p.get("mallocs", -1), p.get("frees", -1)))
PY
done
