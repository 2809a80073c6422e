#!/usr/bin/env bash
# s18 call i7 (issue 14): the decode kernels' shared pieces (visible rows, tile staging, query
# set-up, value code pairs, the partials' merge, also for the CUDA-core kernel) as functions used
# by the 8-head and 16-head blocks. The decode tests, the op harness's decode cases, the batched
# test, the engine test, memcheck of the small decode table; our decode benchmark at H_q 32 and
# 128 (against i4 / i5's numbers of the same kernels before the change).
root=$(pwd)
o=$OUT
w=/tmp/i7
rm -rf $w && mkdir -p $w && tar xJf "$root/carry-i7/gpu.txz" -C $w
export LD_LIBRARY_PATH=$w/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
for d in /usr/local/cuda/lib64 /opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib; do
  [ -e "$d/libcublas.so.13" ] && LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$d
done
export VQ_SOURCE_DIR=$root
cd $w
exec > >(tee -a "$o/run.txt") 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
t() {  # label, limit, command...
  local label=$1 limit=$2; shift 2
  SECONDS=0; timeout "$limit" "$@" >$w/log_$label.txt 2>&1; local rc=$?
  echo "== $label rc=$rc ${SECONDS}s"
  grep -E "^\[(  FAILED|  PASSED)|worst|FAILED TEST|cases" $w/log_$label.txt | head -12
  [ $rc -eq 0 ] || grep -B3 -A25 "Failure\|rror" $w/log_$label.txt | head -60
}
t decode 120 ./test_cuda_decode
t decode_batch 120 ./test_cuda_decode_batch
t harness_decode 200 ./test_backend_ops_cuda --gtest_filter='BackendOpsCuda.DecodeAttention'
t engine 300 ./test_cuda_engine
export VQ_HARNESS=small
SECONDS=0
timeout 150 compute-sanitizer --tool memcheck --error-exitcode 86 --print-limit 20 ./test_backend_ops_cuda \
  --gtest_filter=BackendOpsCuda.DecodeAttention >$w/san.txt 2>&1
echo "== memcheck rc=$? ${SECONDS}s $(grep -E 'ERROR SUMMARY' $w/san.txt | tail -1)"
unset VQ_HARNESS
for hq in 32 128; do
  ./cuda_decode_attention --repeats 20 --no-maintenance --hq $hq >$o/decode_hq$hq.txt 2>&1
  echo "== bench hq $hq rc=$?"
  grep -E "^\| (1|8) \| (4096|32768|131072) \| (fp16 full|skvq K2V2 g32|skvq K4V4 g32) " $o/decode_hq$hq.txt
done
