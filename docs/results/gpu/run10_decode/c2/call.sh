#!/usr/bin/env bash
# s11 call 2 (issue 14): the decode kernels of this session (bulk-copied packed tiles, fp16
# dequantized values with f16 metadata): decode tests, the op harness's decode cases, sanitizer
# memcheck/racecheck/synccheck over its small decode table, the decode benchmark beside main's
# (base/, call 1's binary) at batch 8 and 1, ncu of K2V2 / K4V4 g32 at 8 x 32K.
here=$(cd "$(dirname "$0")" && pwd)
o=$OUT
export PATH=$PATH:/usr/local/cuda/bin
rm -rf /tmp/c2 && mkdir -p /tmp/c2 && tar xJf "$here/gpu.txz" -C /tmp/c2
export LD_LIBRARY_PATH=/tmp/c2/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
for d in /usr/local/cuda/lib64 /opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib; do
  [ -e "$d/libcublas.so.13" ] && LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$d
done
cd /tmp/c2
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader | tee $o/run.txt
st=0
for t in "test_cuda_decode" "test_cuda_decode_batch" "test_cuda_caches" "test_backend_ops_cuda --gtest_filter=BackendOpsCuda.DecodeAttention*"; do
  SECONDS=0
  n=$(echo $t | cut -d' ' -f1)
  timeout 150 ./$t >$o/$n.txt 2>&1; rc=$?
  [ $rc -eq 0 ] || st=1
  echo "$t rc=$rc ${SECONDS}s" | tee -a $o/run.txt
  grep -E "^\[(  FAILED|  PASSED)|worst|Failure|rep=16" $o/$n.txt | head -12 | tee -a $o/run.txt
done
export VQ_HARNESS=small
for tool in memcheck racecheck synccheck; do
  SECONDS=0
  timeout 60 compute-sanitizer --tool $tool --error-exitcode 86 --print-limit 20 ./test_backend_ops_cuda \
    --gtest_filter=BackendOpsCuda.DecodeAttention >/tmp/san_$tool.txt 2>&1
  echo "sanitizer $tool rc=$? ${SECONDS}s $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' /tmp/san_$tool.txt | tail -1) $(grep -E '^\[  PASSED' /tmp/san_$tool.txt)" | tee -a $o/run.txt
  tail -c 3000 /tmp/san_$tool.txt > $o/san_$tool.txt
done
unset VQ_HARNESS
xz -dc "$here/base/cuda_decode_attention.xz" >/tmp/base_bench && chmod +x /tmp/base_bench
for b in 8 1; do
  SECONDS=0; timeout 100 ./cuda_decode_attention --batch $b --repeats 20 --no-maintenance >/tmp/new_$b.txt 2>&1
  echo "new bench batch $b rc=$? ${SECONDS}s" | tee -a $o/run.txt
  SECONDS=0; timeout 100 /tmp/base_bench --batch $b --repeats 20 --no-maintenance >/tmp/base_$b.txt 2>&1
  echo "base bench batch $b rc=$? ${SECONDS}s" | tee -a $o/run.txt
done
for f in /tmp/new_8.txt /tmp/base_8.txt /tmp/new_1.txt /tmp/base_1.txt; do echo "== $f"; grep -E "^\| [18] \| " $f; done >$o/ab.txt
grep -E "K4V4 g32 \||K2V2 g32 \||K2V2 g128 \||fp16 full|bf16 rows|==" $o/ab.txt | tee -a $o/run.txt
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
for m in "skvq K2V2 g32" "skvq K4V4 g32"; do
  n=$(echo "$m" | tr -dc 'A-Za-z0-9')
  SECONDS=0
  timeout 90 "$ncu" --clock-control none -k regex:decode_mma_kernel -c 1 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
    --section WarpStateStats --section InstructionStats \
    --metrics 'regex:^smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$' \
    ./cuda_decode_attention --only "$m" --batch 8 --context 32768 --repeats 3 --no-maintenance >$o/ncu_$n.txt 2>&1
  echo "ncu $m rc=$? ${SECONDS}s" | tee -a $o/run.txt
  grep -E "Duration|DRAM Throughput|Registers Per|Issue Slots Busy|Eligible Warps|Active Warps Per|Executed Instructions  |Block Limit Reg|Block Limit Sh" $o/ncu_$n.txt | head -12 | tee -a $o/run.txt
  grep -E "smsp__average_warps_issue_stalled" $o/ncu_$n.txt | awk '{print $NF, $1}' | sort -rn | head -6 | tee -a $o/run.txt
done
echo "status=$st" | tee -a $o/run.txt
