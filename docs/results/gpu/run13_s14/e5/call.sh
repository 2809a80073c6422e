#!/usr/bin/env bash
# s14 call 5 (issue 13): call e4's binaries (7af284a's tail rule) at the largest batches that fit
# at 32K: full (29) and skvq K2V2 (123), the issue's 3.5x throughput target, and K4V4 (82).
root=$(pwd)
o=$OUT
export PATH=$PATH:/usr/local/cuda/bin
w=/tmp/e5
rm -rf $w && mkdir -p $w && tar xJf "$root/carry-e4/gpu.txz" -C $w
export LD_LIBRARY_PATH=$w/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
for d in /usr/local/cuda/lib64 /opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib; do
  [ -e "$d/libcublas.so.13" ] && LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$d
done
export VQ_SOURCE_DIR=$root
cd $w
exec > >(tee -a "$o/run.txt") 2>&1
M8=/tmp/llama8b
timeout 60 python3 "$root/tools/make_llama_shapes.py" "$M8" --preset 8b | tail -1
bench() {  # name, limit, bench args...
  local name=$1 limit=$2; shift 2
  SECONDS=0
  timeout "$limit" ./veloxquant bench --device cuda --model "$M8" --no-check-weights --json "$@" \
    >"$o/$name.json" 2>$w/$name.err
  echo "== bench $name rc=$? ${SECONDS}s"; tail -2 $w/$name.err
  python3 - "$o/$name.json" <<'PY'
import json, sys
try: j = json.load(open(sys.argv[1]))
except Exception as e: print("  (no JSON:", e, ")"); sys.exit(0)
for m in j["methods"]:
    r = m.get("run", {})
    print("  %-40s batch %3d decode %7.1f (steady %7.1f) tok/s %5.1f%% (steady %5.1f%%) peak %5.1f GiB" % (
        m["method"], m["batch"], r.get("decode_tokens_per_s", 0), r.get("steady_decode_tokens_per_s", 0),
        r.get("decode_pct_of_bound", 0), r.get("steady_decode_pct_of_bound", 0),
        r.get("peak_device_bytes", 0) / 2**30))
PY
}
L="--context 32768 --gen 16 --synthetic-prefill"
bench k2v2_b123 200 --methods skvq:bits_key=2:bits_value=2 --batch 123 $L
bench full_b29 150 --methods full --batch 29 $L
bench k4v4_b82 150 --methods skvq:bits_key=4:bits_value=4 --batch 82 $L
