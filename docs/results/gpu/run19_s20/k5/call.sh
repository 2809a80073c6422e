#!/usr/bin/env bash
# s20 call k5 (issues 13, 14): the engine with this session's decode kernels (vq_new, main at
# 19481bd) against main 020c97f's (vq_old), the same random Llama-3-8B-shaped model
# (tools/make_llama_shapes.py), bench --synthetic-prefill at 8 x 32K (K2V2, K4V4, full) alternated
# twice, then K2V2 at its largest batch (123) once each.
root=$(pwd)
o=$OUT
w=/tmp/k5
rm -rf $w && mkdir -p $w && tar xJf "$root/carry-k5/gpu.txz" -C $w
export LD_LIBRARY_PATH=$w/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
for d in /usr/local/cuda/lib64 /opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib; do
  [ -e "$d/libcublas.so.13" ] && LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$d
done
mkdir -p $w/res
exec > >(tee -a "$w/res/run.txt") 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
cd $w
M8=/tmp/llama8b
[ -f $M8/config.json ] || timeout 90 python3 "$root/tools/make_llama_shapes.py" "$M8" --preset 8b | tail -1
run() {  # VERSION METHOD BATCH TAG
  SECONDS=0
  timeout 200 ./$1 bench --device cuda --model "$M8" --no-check-weights --json --methods "$2" \
    --batch $3 --context 32768 --gen 16 --synthetic-prefill >res/$4.json 2>res/$4.err
  echo "== $1 $2 x $3 rc=$? ${SECONDS}s"
  python3 - res/$4.json <<'PY'
import json, sys
try: j = json.load(open(sys.argv[1]))
except Exception as e: print("no JSON", e); sys.exit(0)
for m in j["methods"]:
    r = m.get("run", {})
    print("  %-32s batch %3d decode %7.1f (steady %7.1f) tok/s %5.1f%% (steady %5.1f%%)" % (
        m["method"], m["batch"], r.get("decode_tokens_per_s", 0), r.get("steady_decode_tokens_per_s", 0),
        r.get("decode_pct_of_bound", 0), r.get("steady_decode_pct_of_bound", 0)))
PY
}
for rep in 1 2; do
  for v in vq_new vq_old; do
    for m in skvq:bits_key=2:bits_value=2 skvq:bits_key=4:bits_value=4 full; do
      run $v $m 8 ${v}_${m//[:=]/_}_8_$rep
    done
  done
done
for v in vq_new vq_old; do run $v skvq:bits_key=2:bits_value=2 123 ${v}_k2v2_123; done
tar czf $o/k5.tgz res
