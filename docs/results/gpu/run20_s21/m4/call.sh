#!/usr/bin/env bash
# s21 call m4 (issues 16, 14): the channel-axis decode kernel's tensor-core path (logits and
# values on mma.m16n8k16: codes as fp16 subnormals against the run's folded query as fp16 hi + lo,
# values dequantized and rounded once to fp16 against fp16 p, fp32 accumulation) beside its
# CUDA-core path (VQ_CHANNEL_CUDA_CORE=1, the same binary): the cache tests through both, memcheck,
# the decode and engine tests; the engine at 8 x 32K and 1 x 32K, both paths; ncu of the new path.
# (Run twice: the first run's benchmarks hit a typo in the method strings; BENCH_ONLY=1 reran them.)
root=$(pwd)
o=$OUT
w=/tmp/m4
[ -n "$BENCH_ONLY" ] && [ -x $w/vq_new ] || { rm -rf $w && mkdir -p $w && tar xJf "$root/carry-m4/gpu.txz" -C $w; }
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
if [ -z "$BENCH_ONLY" ]; then
t test_cuda_caches 400 --gtest_filter='*Channel*'
mv res/test_cuda_caches.txt res/test_cuda_caches_channel_tc.txt
VQ_CHANNEL_CUDA_CORE=1 t test_cuda_caches 400 --gtest_filter='*Channel*'
mv res/test_cuda_caches.txt res/test_cuda_caches_channel_cc.txt
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
fi
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
bench vq_new new_8x32k 300 --methods "skvq:bits_key=2:bits_value=2,$C2,$C3,$C4" $B --phases
VQ_CHANNEL_CUDA_CORE=1 bench vq_new cc_8x32k 300 --methods "$C2,$C3,$C4" $B --phases
bench vq_new new1_1x32k 200 --methods "skvq:bits_key=2:bits_value=2,$C2,$C3" --batch 1 --context 32768 \
  --gen 16 --prefill-step 32768 --synthetic-prefill --phases
VQ_CHANNEL_CUDA_CORE=1 bench vq_new cc1_1x32k 200 --methods "$C2,$C3" --batch 1 --context 32768 \
  --gen 16 --prefill-step 32768 --synthetic-prefill --phases
SECONDS=0
timeout 150 ncu -k regex:decode_channel --launch-count 2 --metrics \
gpu__time_duration.sum,smsp__inst_executed.sum,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,smsp__warp_issue_stalled_short_scoreboard_per_warp_active.pct,smsp__warp_issue_stalled_long_scoreboard_per_warp_active.pct,smsp__warp_issue_stalled_barrier_per_warp_active.pct,smsp__warp_issue_stalled_wait_per_warp_active.pct,smsp__warp_issue_stalled_mio_throttle_per_warp_active.pct,smsp__warp_issue_stalled_math_pipe_throttle_per_warp_active.pct,smsp__warps_eligible.avg.per_cycle_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__registers_per_thread,launch__grid_size,launch__occupancy_limit_registers,launch__occupancy_limit_shared_mem,l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum \
  ./vq_new bench --device cuda --model "$M8" --no-check-weights --methods "$C2" --batch 1 --context 32768 \
  --gen 2 --prefill-step 32768 --synthetic-prefill >res/ncu.txt 2>&1
echo "== ncu rc=$? ${SECONDS}s"
grep -E "decode_channel_kernel|duration|inst_executed|warps_active|issue_active|bank_conflicts|stalled|eligible|dram__|registers|grid_size|occupancy|local" res/ncu.txt | sed 's/  */ /g' | cut -c1-160
tar czf $o/m4.tgz res
