#!/usr/bin/env bash
# s14 call 6 (issue 13): after a snapkv+skvq eviction on the device, the kept full-precision
# store starts with room for its flush span and the kept packed run with room for one window (no
# regrowth in the first flush); before: call e4 (the tail rule alone). Same tests and engine runs.
# Call 4 text follows.
# (e4) on the device the SKVQ full-precision tail keeps room for the rows it
# holds before its next flush (kv::RowBackend::keeps_tail_room) instead of shrinking after each
# flush and doubling back (e2 and e3: skvq's 15.5 syncs, 31 cudaMalloc and 31 cudaFree per decode
# step at 8 x 32K). The cache, SKVQ (with the planner's resident bound) and engine tests, memcheck
# over the SKVQ tests, then the engine as e3: first step (gen 2) and 33 decode steps (gen 34).
here=$(cd "$(dirname "$0")" && pwd)
root=$(pwd)
o=$OUT
export PATH=$PATH:/usr/local/cuda/bin
w=/tmp/e6
rm -rf $w && mkdir -p $w && tar xJf "$here/gpu.txz" -C $w
export LD_LIBRARY_PATH=$w/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
for d in /usr/local/cuda/lib64 /opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib; do
  [ -e "$d/libcublas.so.13" ] && LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$d
done
export VQ_SOURCE_DIR=$root VQ_MODEL_DIR=$root/models/vq-mini-llama
cd $w
exec > >(tee -a "$o/run.txt") 2>&1
for p in test_cuda_caches test_cuda_skvq test_cuda_engine; do
  SECONDS=0; timeout 240 ./$p >$w/log_$p.txt 2>&1; rc=$?
  echo "== $p rc=$rc ${SECONDS}s"; grep -E "^\[(  FAILED|  PASSED)|tests ran|\[plan\]" $w/log_$p.txt | head -12
  [ $rc -eq 0 ] || grep -B2 -A12 "Failure" $w/log_$p.txt | head -60 > $o/fail_$p.txt
done
SECONDS=0
timeout 200 compute-sanitizer --tool memcheck --error-exitcode 86 --print-limit 20 \
  ./test_cuda_skvq >$w/san.txt 2>&1
echo "== memcheck test_cuda_skvq rc=$? ${SECONDS}s $(grep -E 'ERROR SUMMARY' $w/san.txt | tail -1) $(grep -E '^\[  PASSED' $w/san.txt)"
M8=/tmp/llama8b
timeout 60 python3 "$root/tools/make_llama_shapes.py" "$M8" --preset 8b | tail -1
for gen in 2 34 160; do
  SECONDS=0
  timeout 200 ./veloxquant bench --device cuda --model "$M8" --no-check-weights --phases \
    --methods "snapkv+skvq:budget=1024:bits_key=4:bits_value=4,skvq:bits_key=4:bits_value=4,skvq:bits_key=2:bits_value=2,full" \
    --batch 8 --context 32768 --gen $gen --prefill-step 32768 --synthetic-prefill \
    --json >$o/engine_gen$gen.json 2>$w/engine.err
  echo "== engine gen $gen rc=$? ${SECONDS}s"; tail -3 $w/engine.err
  python3 - $o/engine_gen$gen.json <<'PY'
import json, sys
try: j = json.load(open(sys.argv[1]))
except Exception as e: print("no JSON", e); sys.exit(0)
for m in j["methods"]:
    r = m.get("run", {})
    print("%-50s decode %7.1f steady %7.1f tok/s (%.1f%% of bound) first step %.1f ms peak %.1f GiB" % (m["method"], r.get("decode_tokens_per_s", 0), r.get("steady_decode_tokens_per_s", 0), r.get("steady_decode_pct_of_bound", 0), 1e3 * r.get("first_decode_step_seconds", 0), r.get("peak_device_bytes", 0) / 2**30))
    for p in m.get("phases", []):
        if p["decode"] and p["phase"] in ("cache update", "attention"):
            n = p["steps"]
            print("    %-26s device %8.3f ms host %8.3f ms | syncs %6.1f mallocs %6.1f frees %6.1f per step (%d steps)" % (p["phase"], p["gpu_seconds"] / n * 1e3, p["host_seconds"] / n * 1e3, p.get("syncs", -1) / n, p.get("mallocs", -1) / n, p.get("frees", -1) / n, n))
PY
done
