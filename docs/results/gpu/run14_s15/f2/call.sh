#!/usr/bin/env bash
# s15 call f2 (issues 13, 14): "kern" = call f1's subnormal key codes + the RMSNorm kernel issuing
# a round of 8 loads per thread before its stores (it waited for memory once per element: 64
# norms took 1.1 ms of an 8 x 32K decode step, s14 e4); "main" = main's veloxquant; kern also has helper 43's src/kv commits. The kern
# build's engine, cache and SKVQ tests (with helper 43's snapkv+skvq store changes, src/kv); the
# engine at 8 x 32K main / kern / main / kern with --phases; the largest batches at 32K (K2V2 x
# 123, full x 29) with kern; snapkv+skvq at gen 2 and 160 (store calls per step) with kern. Everything in run.txt and two JSON files.
here=$(cd "$(dirname "$0")" && pwd)
root=$(pwd)
o=$OUT
export PATH=$PATH:/usr/local/cuda/bin
w=/tmp/f2
rm -rf $w && mkdir -p $w && tar xJf "$here/f2.txz" -C $w
export LD_LIBRARY_PATH=$w/kern/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
for d in /usr/local/cuda/lib64 /opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib; do
  [ -e "$d/libcublas.so.13" ] && LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$d
done
export VQ_SOURCE_DIR=$root VQ_MODEL_DIR=$root/models/vq-mini-llama
cd $w/kern
exec > >(tee -a "$o/run.txt") 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
t() {
  local label=$1 limit=$2; shift 2
  SECONDS=0; timeout "$limit" "$@" >$w/log_$label.txt 2>&1; local rc=$?
  echo "== $label rc=$rc ${SECONDS}s"
  grep -E "^\[(  FAILED|  PASSED)|worst|FAILED TEST|tests ran" $w/log_$label.txt | head -12
  [ $rc -eq 0 ] || grep -B3 -A15 "Failure" $w/log_$label.txt | head -60
}
t engine 240 ./test_cuda_engine
t caches 120 ./test_cuda_caches
t skvq 90 ./test_cuda_skvq
M8=/tmp/llama8b
timeout 60 python3 "$root/tools/make_llama_shapes.py" "$M8" --preset 8b | tail -1
show() {
  python3 - "$1" <<'PY'
import json, sys
try: j = json.load(open(sys.argv[1]))
except Exception as e: print("no JSON", e); sys.exit(0)
for m in j["methods"]:
    r = m.get("run", {})
    print("  %-48s b %3d decode %7.1f steady %7.1f tok/s (%.1f%% of bound) prefill %.0f tok/s peak %.1f GiB" % (m["method"], m.get("batch", 0), r.get("decode_tokens_per_s", 0), r.get("steady_decode_tokens_per_s", 0), r.get("steady_decode_pct_of_bound", 0), r.get("prefill_tokens_per_s", 0), r.get("peak_device_bytes", 0) / 2**30))
    for p in m.get("phases", []):
        if p["decode"]:
            n = p["steps"]
            print("      %-24s device %7.3f ms host %7.3f ms | syncs %5.1f mallocs %5.1f frees %5.1f" % (p["phase"], p["gpu_seconds"] / n * 1e3, p["host_seconds"] / n * 1e3, p.get("syncs", -1) / n, p.get("mallocs", -1) / n, p.get("frees", -1) / n))
PY
}
for v in main kern main kern; do
  SECONDS=0
  timeout 150 $w/$v/veloxquant bench --device cuda --model "$M8" --no-check-weights --phases \
    --methods "full,skvq:bits_key=4:bits_value=4,skvq:bits_key=2:bits_value=2,snapkv+skvq:budget=1024:bits_key=4:bits_value=4" \
    --batch 8 --context 32768 --gen 34 --prefill-step 32768 --synthetic-prefill \
    --json >$w/engine_$v.json 2>$w/engine.err
  echo "== engine 8 x 32K $v rc=$? ${SECONDS}s"; tail -2 $w/engine.err; show $w/engine_$v.json
done
cp $w/engine_kern.json $o/engine_8x32k_kern.json
for gen in 2 160; do
  SECONDS=0
  timeout 150 ./veloxquant bench --device cuda --model "$M8" --no-check-weights --phases \
    --methods "snapkv+skvq:budget=1024:bits_key=4:bits_value=4" --batch 8 --context 32768 --gen $gen \
    --prefill-step 32768 --synthetic-prefill --json >$w/snap_$gen.json 2>$w/engine.err
  echo "== engine snapkv+skvq gen $gen kern rc=$? ${SECONDS}s"; tail -2 $w/engine.err; show $w/snap_$gen.json
done
for mb in "skvq:bits_key=2:bits_value=2 123" "full 29"; do
  set -- $mb
  SECONDS=0
  timeout 200 ./veloxquant bench --device cuda --model "$M8" --no-check-weights --methods "$1" \
    --batch $2 --context 32768 --gen 34 --prefill-step 32768 --synthetic-prefill \
    --json >$w/largest_$2.json 2>$w/engine.err
  echo "== engine largest $1 x $2 rc=$? ${SECONDS}s"; tail -2 $w/engine.err; show $w/largest_$2.json
done
cat $w/largest_123.json > $o/largest_k2v2_123.json
