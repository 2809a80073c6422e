#!/usr/bin/env bash
# s15 call f3 (issues 13, 14): the decode benchmark at batch 8 for "kern" (main + f1's subnormal
# key codes), "s2" (kern with 2-stage pipelines for every packed view and a 5-block register cap
# for 2-bit views) and "mb5" (f1's 5-block cap run with 64-row-smaller packed stages through the
# planner knob --packed-stage-bytes 6144), interleaved twice; then kern's engine at the largest
# batches of 32K (as s14 e5: --gen 16, default prefill step): K2V2 x 123, full x 29, K4V4 x 82.
here=$(cd "$(dirname "$0")" && pwd)
root=$(pwd)
o=$OUT
export PATH=$PATH:/usr/local/cuda/bin
w=/tmp/f3
rm -rf $w && mkdir -p $w && tar xJf "$here/f3.txz" -C $w
export LD_LIBRARY_PATH=$w/kern/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
for d in /usr/local/cuda/lib64 /opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib; do
  [ -e "$d/libcublas.so.13" ] && LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$d
done
export VQ_SOURCE_DIR=$root
cd $w/kern
exec > >(tee -a "$o/run.txt") 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
sel='^\| 8 \| (32768|131072) \| skvq (K4V4|K2V2) g32 \|'
for r in 1 2; do for v in kern s2 mb5; do
  extra=""; [ $v = mb5 ] && extra="--packed-stage-bytes 6144"
  SECONDS=0; timeout 80 $w/$v/cuda_decode_attention --repeats 20 --no-maintenance --batch 8 $extra \
    >$w/b8_${v}_$r.txt 2>&1
  echo "== decode bench $v round $r rc=$? ${SECONDS}s"; grep -E "$sel" $w/b8_${v}_$r.txt
done; done
cp $w/b8_kern_1.txt $w/b8_s2_1.txt $o/
M8=/tmp/llama8b
timeout 60 python3 "$root/tools/make_llama_shapes.py" "$M8" --preset 8b | tail -1
for mb in "skvq:bits_key=2:bits_value=2 123" "full 29" "skvq:bits_key=4:bits_value=4 82"; do
  set -- $mb
  SECONDS=0
  timeout 200 ./veloxquant bench --device cuda --model "$M8" --no-check-weights --json --methods "$1" \
    --batch $2 --context 32768 --gen 16 --synthetic-prefill >$w/largest_$2.json 2>$w/engine.err
  echo "== engine largest $1 x $2 rc=$? ${SECONDS}s"; tail -2 $w/engine.err
  python3 - $w/largest_$2.json <<'PY'
import json, sys
try: j = json.load(open(sys.argv[1]))
except Exception as e: print("no JSON", e); sys.exit(0)
for m in j["methods"]:
    r = m.get("run", {})
    print("  %-40s batch %3d decode %7.1f (steady %7.1f) tok/s %5.1f%% (steady %5.1f%%) peak %5.1f GiB" % (
        m["method"], m["batch"], r.get("decode_tokens_per_s", 0), r.get("steady_decode_tokens_per_s", 0),
        r.get("decode_pct_of_bound", 0), r.get("steady_decode_pct_of_bound", 0), r.get("peak_device_bytes", 0) / 2**30))
PY
  cp $w/largest_$2.json $o/
done
