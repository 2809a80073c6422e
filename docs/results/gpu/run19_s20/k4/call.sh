#!/usr/bin/env bash
# s20 call k4 (issues 13, 14, 19) on main after 19481bd (the lane-unit packed values and the
# swizzled merge buffer) and the merge of h48-cpu-keys: (1) the CUDA decode-batch, cache and engine
# tests; (2) the engine on a random Llama-3-8B-shaped model (tools/make_llama_shapes.py) at the
# largest 32K batches of session 15 (K2V2 x 123, full x 29, K4V4 x 82) and at 8 x 32K, each a
# separate process (bench --synthetic-prefill, 16 generated tokens); (3) issue 19 on the host's CPU
# (16 cores): bench_e2e and bench_decode_attention of the x86-64-v4 bundle (host_run.sh's steps
# without llama.cpp).
root=$(pwd)
o=$OUT
export PATH=$PATH:/usr/local/cuda/bin
w=/tmp/k4
rm -rf $w && mkdir -p $w && tar xJf "$root/carry-k4/gpu.txz" -C $w
export LD_LIBRARY_PATH=$w/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
for d in /usr/local/cuda/lib64 /opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib; do
  [ -e "$d/libcublas.so.13" ] && LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$d
done
export VQ_SOURCE_DIR=$root VQ_MODEL_DIR=$root/models/vq-mini-llama
mkdir -p $w/res
exec > >(tee -a "$w/res/run.txt") 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
cd $w
for t in test_cuda_decode_batch test_cuda_caches test_cuda_engine; do
  SECONDS=0; timeout 200 ./$t >res/$t.txt 2>&1
  echo "== $t rc=$? ${SECONDS}s"; grep -E "^\[  (PASSED|FAILED) |tests ran" res/$t.txt | head -5
done
M8=/tmp/llama8b
timeout 90 python3 "$root/tools/make_llama_shapes.py" "$M8" --preset 8b | tail -1
for mb in "skvq:bits_key=2:bits_value=2 123" "full 29" "skvq:bits_key=4:bits_value=4 82" \
  "full 8" "skvq:bits_key=4:bits_value=4 8" "skvq:bits_key=2:bits_value=2 8"; do
  set -- $mb
  SECONDS=0
  timeout 200 ./veloxquant bench --device cuda --model "$M8" --no-check-weights --json --methods "$1" \
    --batch $2 --context 32768 --gen 16 --synthetic-prefill >res/engine_${1%%:*}_$2.json 2>res/engine.err
  echo "== engine $1 x $2 rc=$? ${SECONDS}s"; tail -1 res/engine.err
  python3 - res/engine_${1%%:*}_$2.json <<'PY'
import json, sys
try: j = json.load(open(sys.argv[1]))
except Exception as e: print("no JSON", e); sys.exit(0)
for m in j["methods"]:
    r = m.get("run", {})
    print("  %-40s batch %3d decode %7.1f (steady %7.1f) tok/s %5.1f%% (steady %5.1f%%) peak %5.1f GiB" % (
        m["method"], m["batch"], r.get("decode_tokens_per_s", 0), r.get("steady_decode_tokens_per_s", 0),
        r.get("decode_pct_of_bound", 0), r.get("steady_decode_pct_of_bound", 0), r.get("peak_device_bytes", 0) / 2**30))
PY
done
if [ -x "$root/carry-k4/host/bench_e2e" ]; then
  h=$root/carry-k4/host
  cd "$root"
  LD_LIBRARY_PATH=$h/lib:$LD_LIBRARY_PATH
  methods="full;skvq:bits_key=4:bits_value=4;skvq:bits_key=2:bits_value=2"
  lscpu | grep -E "Model name|^CPU\(s\)" ; uptime
  for th in 16 2 1; do
    SECONDS=0
    timeout 120 $h/bench_e2e --prefill-step 2048 --contexts 2048,8192 --methods "$methods" \
      --threads $th --repeats 2 --decode 48 --cpu-time >$w/res/e2e_t$th.txt 2>&1
    echo "== host e2e threads $th rc=$? ${SECONDS}s"; grep -E "^\| (2048|8192) " $w/res/e2e_t$th.txt
  done
  timeout 60 $h/bench_decode_attention --contexts 32768 --shape 2,64,3 --repeats 20 --threads 1,2,16 \
    >$w/res/dec_attn.txt 2>&1
  echo "== host decode attention rc=$?"; grep -E "K4V4|K2V2|fp16" $w/res/dec_attn.txt | head -20
fi
cd $w && tar czf $o/k4.tgz res
