#!/usr/bin/env bash
# s21 call m6 (issues 16, 14): the channel-axis decode kernel after m5's source counters (the
# fold's run metadata read from the staged tile with offsets computed once per thread, no
# division per run; each value code's mask and exponent in one lop3; the value rows two at a
# time) against main's kernel (vq_old, a6df323) in the same call: the channel-axis cache tests
# and memcheck; the engine at 8 x 32K (twice each, alternated) and 1 x 32K.
root=$(pwd)
o=$OUT
w=/tmp/m6
rm -rf $w && mkdir -p $w && tar xJf "$root/carry-m6/gpu.txz" -C $w
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
C4=skvq:bits_key=4:bits_value=2:key_axis=channel:meta=fp8_e4m3
for rep in 1 2; do
  bench vq_new new_8x32k_$rep 300 --methods "$C2,$C3,$C4" $B --phases
  bench vq_old old_8x32k_$rep 300 --methods "$C2,$C3,$C4" $B --phases
done
for v in vq_new vq_old; do
  bench $v ${v}_1x32k 200 --methods "$C2,$C3" --batch 1 --context 32768 --gen 16 --prefill-step 32768 \
    --synthetic-prefill --phases
done
tar czf $o/m6.tgz res
