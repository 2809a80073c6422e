#!/usr/bin/env bash
# kdec call 1 (run 9): the decode programs of this branch (VQ_BUNDLE=decode bundle in c1/): the
# decode tests, the op harness's decode cases (GQA 16 included), compute-sanitizer memcheck and
# racecheck over its small decode table, this branch's decode benchmark beside main's (base/,
# A/B at batch 8), and ncu of the K4V4 g32 kernel at 8 x 32K (2 stages).
here=$(cd "$(dirname "$0")" && pwd)
o=$OUT
export PATH=$PATH:/usr/local/cuda/bin
rm -rf /tmp/vq-gpu && mkdir -p /tmp/vq-gpu && tar xJf "$here/c1/gpu.txz" -C /tmp/vq-gpu
export LD_LIBRARY_PATH=/tmp/vq-gpu/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
cd /tmp/vq-gpu
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader | tee $o/run.txt
st=0
for t in "test_cuda_decode" "test_cuda_caches" "test_backend_ops_cuda --gtest_filter=BackendOpsCuda.DecodeAttention*"; do
  SECONDS=0
  timeout 150 ./$t >$o/$(echo $t | cut -d' ' -f1).txt 2>&1; rc=$?
  [ $rc -eq 0 ] || st=1
  echo "$t rc=$rc ${SECONDS}s" | tee -a $o/run.txt
  grep -E "^\[(  FAILED|  PASSED)|worst|Failure|rep=16" $o/$(echo $t | cut -d' ' -f1).txt | head -12 | tee -a $o/run.txt
done
export VQ_HARNESS=small
for tool in memcheck racecheck; do
  SECONDS=0
  timeout 70 compute-sanitizer --tool $tool --error-exitcode 86 --print-limit 20 ./test_backend_ops_cuda \
    --gtest_filter=BackendOpsCuda.DecodeAttention >/tmp/san_$tool.txt 2>&1
  echo "sanitizer $tool rc=$? ${SECONDS}s $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' /tmp/san_$tool.txt | tail -1) $(grep -E '^\[  PASSED' /tmp/san_$tool.txt)" | tee -a $o/run.txt
  cp /tmp/san_$tool.txt $o/ 2>/dev/null
done
unset VQ_HARNESS
# A/B in one call: this branch's benchmark and main's (base/, the 3-stage pipeline), batch 8
if [ -f "$here/base/cuda_decode_attention.xz" ]; then
  xz -dc "$here/base/cuda_decode_attention.xz" >/tmp/base_bench && chmod +x /tmp/base_bench
  for pass in 1; do
    SECONDS=0; timeout 100 ./cuda_decode_attention --batch 8 --repeats 20 --no-maintenance --csv /tmp/new.csv >/tmp/new_$pass.txt 2>&1
    echo "new bench pass $pass rc=$? ${SECONDS}s" | tee -a $o/run.txt
    SECONDS=0; timeout 100 /tmp/base_bench --batch 8 --repeats 20 --no-maintenance --csv /tmp/base.csv >/tmp/base_$pass.txt 2>&1
    echo "base bench pass $pass rc=$? ${SECONDS}s" | tee -a $o/run.txt
  done
  for f in /tmp/new_1.txt /tmp/base_1.txt; do echo "== $f"; grep -E "^\| 8 \| " $f; done >$o/ab.txt
  grep -E "K4V4 g32 \||K2V2 g32 \||fp16 full" $o/ab.txt | tee -a $o/run.txt
fi
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
SECONDS=0
timeout 90 "$ncu" --clock-control none -k regex:decode_mma_kernel -c 1 \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
  --section WarpStateStats --section InstructionStats \
  ./cuda_decode_attention --only "skvq K4V4 g32" --batch 8 --context 32768 --repeats 3 --no-maintenance >$o/ncu_k4v4.txt 2>&1
echo "ncu rc=$? ${SECONDS}s" | tee -a $o/run.txt
grep -E "Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Issue Slots Busy|Eligible Warps|Active Warps Per|Block Limit|Executed Instructions  |Dynamic Shared" $o/ncu_k4v4.txt | head -24 | tee -a $o/run.txt
echo "status=$st" | tee -a $o/run.txt
