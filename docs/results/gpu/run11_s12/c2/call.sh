#!/usr/bin/env bash
# s12 call 2 (issue 13): the engine at branch s12-lead (s11-kparam merged; planner of s11-plan) on
# a random Llama-3-8B-shaped model: the largest batch at 32K at the default prefill step 512 for
# full, skvq K2V2 and K4V4 in one run (each method alone in its process: the ratio K2V2 / full is
# the issue's 3.5x target), 8 x 32K for all five methods, 1 x 32K real prefill, 1 x 4K, and
# transformers' generate (bf16, SDPA, DynamicCache) at 8 x 32K and 1 x 32K on the same weights.
here=$(cd "$(dirname "$0")" && pwd)
root=$(pwd)
o=$OUT
rm -rf /tmp/c2 && mkdir -p /tmp/c2 && tar xJf "$here/gpu.txz" -C /tmp/c2
export LD_LIBRARY_PATH=/tmp/c2/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
for d in /usr/local/cuda/lib64 /opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib; do
  [ -e "$d/libcublas.so.13" ] && LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$d
done
export VQ_SOURCE_DIR=$root VQ_MODEL_DIR=$root/models/vq-mini-llama
V=/tmp/c2/veloxquant
M8=/tmp/llama8b
exec > >(tee -a "$o/run.txt") 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.total --format=csv,noheader
run() {  # label, limit, command...
  local label=$1 limit=$2; shift 2
  echo "=== $label: $*"
  SECONDS=0; timeout "$limit" "$@"; echo "=== $label rc=$? ${SECONDS}s"
}
bench() {  # json name, limit, bench args... (JSON to OUT/name.json, stderr to the log)
  local name=$1 limit=$2; shift 2
  echo "=== bench $name: $*"
  SECONDS=0
  timeout "$limit" "$V" bench --device cuda --model "$M8" --no-check-weights --json "$@" \
    >"$o/$name.json" 2>/tmp/c2/$name.err
  echo "=== bench $name rc=$? ${SECONDS}s"; tail -2 /tmp/c2/$name.err
  python3 - "$o/$name.json" <<'PY'
import json, sys
try:
    j = json.load(open(sys.argv[1]))
except Exception as e:
    print("  (no JSON:", e, ")"); sys.exit(0)
for m in j["methods"]:
    r = m.get("run", {})
    print("  %-60s batch %4d plan %4d prefill %8.0f tok/s decode %8.1f (steady %8.1f) tok/s "
          "%5.1f%% (steady %5.1f%%) of bound, peak %6.1f GiB, fill %.0f s" % (
          m["method"], m["batch"], m["plan"]["max_sequences"], r.get("prefill_tokens_per_s", 0),
          r.get("decode_tokens_per_s", 0), r.get("steady_decode_tokens_per_s", 0),
          r.get("decode_pct_of_bound", 0), r.get("steady_decode_pct_of_bound", 0),
          r.get("peak_device_bytes", 0) / 2**30, r.get("synthetic_fill_seconds", 0)))
PY
}
cd /tmp/c2
run make_llama_shapes 60 python3 "$root/tools/make_llama_shapes.py" "$M8" --preset 8b | tail -1
B="--context 32768 --gen 16 --synthetic-prefill"
bench fit_full 100 --methods full --max-batch-fit $B
bench fit_k2v2 160 --methods skvq:bits_key=2:bits_value=2 --max-batch-fit $B
S=budget=1024:scoring=query:pool_kernel=15:keep_window=true:evict_at=prompt_end
bench b8x32k 80 --methods "full,skvq:bits_key=4:bits_value=4,skvq:bits_key=2:bits_value=2,snapkv:$S,snapkv+skvq:$S:bits_key=4:bits_value=4" --batch 8 --prefill-step 32768 $B
bench b1x32k 50 --methods full,skvq:bits_key=2:bits_value=2 --batch 1 --context 32768 --gen 4 --prefill-step 8192
cd "$root"
run "transformers 8x32k" 70 python3 tools/bench_transformers.py "$M8" --batch 8 --context 32768 \
  --gen 16 --repeats 1 --out "$o/tf_8x32k.json"
run "transformers 1x32k" 40 python3 tools/bench_transformers.py "$M8" --batch 1 --context 32768 \
  --gen 4 --repeats 1 --out "$o/tf_1x32k.json"
cd /tmp/c2
bench fit_k4v4 100 --methods skvq:bits_key=4:bits_value=4 --max-batch-fit $B
