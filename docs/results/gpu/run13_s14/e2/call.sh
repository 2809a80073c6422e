#!/usr/bin/env bash
# s14 call 2 (issue 13): the engine at 8 x 32K with --phases, now with the waiting runtime calls
# per phase and step (stream syncs, cudaMalloc, cudaFree; src/cuda/counters.h), for snapkv,
# snapkv+skvq and skvq K4V4: where snapkv+skvq's steady decode (688 tok/s against snapkv's 970,
# call e1) loses its time.
here=$(cd "$(dirname "$0")" && pwd)
root=$(pwd)
o=$OUT
export PATH=$PATH:/usr/local/cuda/bin
w=/tmp/e2
rm -rf $w && mkdir -p $w && tar xJf "$here/gpu.txz" -C $w
export LD_LIBRARY_PATH=$w/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
for d in /usr/local/cuda/lib64 /opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib; do
  [ -e "$d/libcublas.so.13" ] && LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$d
done
cd $w
exec > >(tee -a "$o/run.txt") 2>&1
M8=/tmp/llama8b
timeout 60 python3 "$root/tools/make_llama_shapes.py" "$M8" --preset 8b | tail -1
export VQ_SOURCE_DIR=$root
for gen in 2 34; do
  SECONDS=0
  timeout 200 ./veloxquant bench --device cuda --model "$M8" --no-check-weights --phases \
    --methods "snapkv:budget=1024,snapkv+skvq:budget=1024:bits_key=4:bits_value=4,skvq:bits_key=4:bits_value=4" \
    --batch 8 --context 32768 --gen $gen --prefill-step 32768 --synthetic-prefill \
    --json >$o/engine_gen$gen.json 2>$w/engine.err
  echo "== engine gen $gen rc=$? ${SECONDS}s"; tail -3 $w/engine.err
  python3 - $o/engine_gen$gen.json <<'PY'
import json, sys
try: j = json.load(open(sys.argv[1]))
except Exception as e: print("no JSON", e); sys.exit(0)
for m in j["methods"]:
    r = m.get("run", {})
    print("%-50s decode %7.1f steady %7.1f tok/s first step %.1f ms" % (m["method"], r.get("decode_tokens_per_s", 0), r.get("steady_decode_tokens_per_s", 0), 1e3 * r.get("first_decode_step_seconds", 0)))
    for p in m.get("phases", []):
        if p["decode"]:
            n = p["steps"]
            print("    %-26s device %8.3f ms host %8.3f ms | syncs %6.1f mallocs %6.1f frees %6.1f per step (%d steps)" % (p["phase"], p["gpu_seconds"] / n * 1e3, p["host_seconds"] / n * 1e3, p.get("syncs", -1) / n, p.get("mallocs", -1) / n, p.get("frees", -1) / n, n))
PY
done
