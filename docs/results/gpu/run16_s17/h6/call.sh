#!/usr/bin/env bash
# s17 call h6 (issue 13): the engine's prefill at 8 x 32K (real prefill, steps of 8192 tokens) on a
# random Llama-3-8B-shaped model made here (tools/make_llama_shapes.py --preset 8b), full, skvq
# K4V4 and skvq K2V2, with transformers' generate (bf16, SDPA, DynamicCache) at 8 x 32K on the same
# folder in the same call (tools/bench_transformers.py). main at 0828803 + docs.
here=$(cd "$(dirname "$0")" && pwd)
root=$(pwd)
o=$OUT
export PATH=$PATH:/usr/local/cuda/bin
w=/tmp/h6
rm -rf $w && mkdir -p $w && tar xJf "$root/carry-h6/h6.txz" -C $w
export LD_LIBRARY_PATH=$w/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
for d in /usr/local/cuda/lib64 /opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib; do
  [ -e "$d/libcublas.so.13" ] && LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$d
done
exec > >(tee -a "$o/run.txt") 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
M8=/tmp/llama8b
SECONDS=0; timeout 120 python3 "$root/tools/make_llama_shapes.py" "$M8" --preset 8b | tail -1; echo "== shapes ${SECONDS}s"
for m in full skvq:bits_key=4:bits_value=4 skvq:bits_key=2:bits_value=2; do
  n=$(echo "$m" | tr -dc 'A-Za-z0-9')
  SECONDS=0
  timeout 150 $w/veloxquant bench --device cuda --model "$M8" --no-check-weights --json \
    --methods "$m" --batch 8 --context 32768 --gen 4 --prefill-step 8192 >$o/e_$n.json 2>$w/e_$n.err
  echo "== engine 8x32K $m rc=$? ${SECONDS}s"
  python3 -c "
import json
j=json.load(open('$o/e_$n.json'))
for m in j['methods']:
  r=m.get('run',{}); print('  %-34s prefill %8.0f tok/s decode %7.1f tok/s peak %.1f GiB'%(m['method'],r.get('prefill_tokens_per_s',0),r.get('decode_tokens_per_s',0),r.get('peak_device_bytes',0)/2**30))
" || tail -5 $w/e_$n.err
done
cd "$root"
SECONDS=0
timeout 200 python3 tools/bench_transformers.py "$M8" --batch 8 --context 32768 --gen 4 --repeats 1 \
  --out $o/tf.json >$w/tf.txt 2>&1
echo "== transformers 8x32K rc=$? ${SECONDS}s"
python3 -c "
import json; j=json.load(open('$o/tf.json')); print({k:v for k,v in j.items() if 'prefill' in k or 'decode' in k or 'peak' in k})" 2>&1 | head -5
tail -3 $w/tf.txt
