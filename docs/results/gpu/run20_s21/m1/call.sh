#!/usr/bin/env bash
# s21 call m1 (issues 16, 14): the rewritten channel-axis decode kernel
# (src/cuda/decode_attention_channel.cu: a row per thread for the logits, word loads with
# compile-time shifts, a block-wide softmax step, value units of 4-8 channels). The device cache
# tests (ChannelAxisKeysMatchCpu with four new D 128 cases), memcheck over them, the decode and
# engine tests; then the engine at 8 x 32K on a random Llama-3-8B-shaped model: channel-axis
# caches with the new kernel (vq_new) and main's (vq_old), token-axis K2V2 beside them.
root=$(pwd)
o=$OUT
w=/tmp/m1
rm -rf $w && mkdir -p $w && tar xJf "$root/carry-m1/gpu.txz" -C $w
export LD_LIBRARY_PATH=$w/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
for d in /usr/local/cuda/lib64 /opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib; do
  [ -e "$d/libcublas.so.13" ] && LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$d
done
export PATH=$PATH:/usr/local/cuda/bin
export VQ_SOURCE_DIR=$root VQ_MODEL_DIR=$root/models/vq-mini-llama
mkdir -p $w/res
exec > >(tee -a "$w/res/run.txt") 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
cd $w
t() {  # program, limit, args
  local prog=$1 limit=$2; shift 2
  SECONDS=0
  timeout "$limit" ./$prog "$@" >res/$prog.txt 2>&1
  echo "== $prog $* rc=$? ${SECONDS}s $(grep -E '^\[  (PASSED|FAILED)' res/$prog.txt | tr '\n' ' ')"
  grep -E "^\[  FAILED|worst decode|Failure|error" res/$prog.txt | head -12
}
t test_cuda_caches 400 --gtest_filter='*Channel*'
SECONDS=0
timeout 400 compute-sanitizer --tool memcheck --error-exitcode 86 --print-limit 20 ./test_cuda_caches \
  --gtest_filter='*ChannelAxis*' >res/san.txt 2>&1
echo "== memcheck ChannelAxisKeysMatchCpu rc=$? ${SECONDS}s $(grep -E 'ERROR SUMMARY' res/san.txt | tail -1)"
grep -m5 -E "Invalid|out of bounds|misaligned" res/san.txt
t test_cuda_decode 200
t test_cuda_engine 400
mv res/test_cuda_caches.txt res/test_cuda_caches_channel.txt
t test_cuda_caches 600
M8=/tmp/llama8b
[ -f $M8/config.json ] || timeout 120 python3 "$root/tools/make_llama_shapes.py" "$M8" --preset 8b | tail -1
bench() {  # binary, json name, limit, bench args...
  local bin=$1 name=$2 limit=$3; shift 3
  SECONDS=0
  timeout "$limit" ./$bin bench --device cuda --model "$M8" --no-check-weights --json "$@" \
    >res/$name.json 2>res/$name.err
  echo "== $bin bench $name rc=$? ${SECONDS}s"; tail -2 res/$name.err
  python3 - res/$name.json <<'PY'
import json, sys
try:
    j = json.load(open(sys.argv[1]))
except Exception as e:
    print("  (no JSON:", e, ")"); sys.exit(0)
for m in j["methods"]:
    r = m.get("run", {})
    print("  %-70s batch %3d decode %7.1f (steady %7.1f) tok/s %5.1f%% (steady %5.1f%%) peak %5.1f GiB" % (
        m["method"], m["batch"], r.get("decode_tokens_per_s", 0), r.get("steady_decode_tokens_per_s", 0),
        r.get("decode_pct_of_bound", 0), r.get("steady_decode_pct_of_bound", 0),
        r.get("peak_device_bytes", 0) / 2**30))
    for p in m.get("phases", []):
        if p["decode"] and p["phase"] in ("attention", "cache update"):
            print("    %-26s device %7.3f ms host %7.3f ms" % (p["phase"], p["gpu_seconds"] / p["steps"] * 1e3,
                  p["host_seconds"] / p["steps"] * 1e3))
PY
}
B="--batch 8 --context 32768 --gen 16 --prefill-step 32768 --synthetic-prefill"
C2=skvq:bits_key=2:bits_value=2:key_axis=channel:rotation=hadamard:meta=fp8_e4m3:key_rows=32
C3=skvq:bits_key=3:bits_value=3:key_axis=channel:rotation=hadamard:meta=fp8_e4m3
bench vq_new new_8x32k 300 --methods "skvq:bits_key=2:bits_value=2,$C2,$C3" $B --phases
bench vq_old old_8x32k 300 --methods "$C2" $B --phases
bench vq_new new1_1x32k 200 --methods "skvq:bits_key=2:bits_value=2,$C2" --batch 1 --context 32768 \
  --gen 16 --prefill-step 32768 --synthetic-prefill --phases
tar czf $o/m1.tgz res
