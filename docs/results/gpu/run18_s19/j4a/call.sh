#!/usr/bin/env bash
# s19 call j4a (issue 14): the split kernels merge their own splits (the last block of each
# (b, KV head) by arrival counters, merge_if_last in decode_attention_kernel.cuh) and the combine
# kernel runs only for channel-axis views and unaligned outputs. Tests (decode with the new
# in-kernel / combine test, batched, the op harness, caches), memcheck and racecheck of the
# harness's small decode table; the decode benchmark merging in the split kernels (the default)
# and with --combine-kernel (the combine kernel, as before), interleaved, twice, at H_q 32 and
# 128 (read flush).
root=$(pwd)
o=$OUT
w=/tmp/j4a
rm -rf $w && mkdir -p $w && tar xJf "$root/carry-j4a/gpu.txz" -C $w
export LD_LIBRARY_PATH=$w/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
for d in /usr/local/cuda/lib64 /opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib; do
  [ -e "$d/libcublas.so.13" ] && LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$d
done
export VQ_SOURCE_DIR=$root PATH=$PATH:/usr/local/cuda/bin
cd $w
mkdir -p res
exec > >(tee -a "$w/res/run.txt") 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
t() {  # label, limit, command...
  local label=$1 limit=$2; shift 2
  SECONDS=0; timeout "$limit" "$@" >res/log_$label.txt 2>&1; local rc=$?
  echo "== $label rc=$rc ${SECONDS}s"
  grep -E "^\[(  FAILED|  PASSED)|FAILED TEST|tests ran|worst|decode_attention \[" res/log_$label.txt | head -30
  [ $rc -eq 0 ] || grep -B3 -A25 "Failure\|rror" res/log_$label.txt | head -80
}
t decode 120 ./test_cuda_decode
t decode_batch 120 ./test_cuda_decode_batch
t harness 400 ./test_backend_ops_cuda
t caches 300 ./test_cuda_caches
export VQ_HARNESS=small
for tool in memcheck racecheck; do
  SECONDS=0
  timeout 200 compute-sanitizer --tool $tool --error-exitcode 86 --print-limit 20 ./test_backend_ops_cuda \
    --gtest_filter=BackendOpsCuda.DecodeAttention >res/san_$tool.txt 2>&1
  echo "== $tool rc=$? ${SECONDS}s $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' res/san_$tool.txt | tail -1)"
done
unset VQ_HARNESS
for rep in 1 2; do
  for hq in 32 128; do
    for v in merge combine; do
      timeout 150 ./cda --repeats 20 --no-maintenance --hq $hq --csv res/bench_hq${hq}_${v}_$rep.csv \
        $([ $v = combine ] && echo --combine-kernel) >res/decode_hq${hq}_${v}_$rep.txt 2>&1
      echo "== $v hq $hq $rep rc=$?"
    done
  done
done
grep -E "^\| (1|8) \| (4096|32768|131072) \| (fp16 full|skvq K2V2 g32|skvq K4V4 g32|skvq K3V3 g32) " res/decode_hq32_merge_1.txt res/decode_hq32_combine_1.txt
tar czf $o/j4a.tgz res
