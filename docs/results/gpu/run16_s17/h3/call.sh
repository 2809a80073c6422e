#!/usr/bin/env bash
# s17 call h3 (issue 14): the kv_rep blocks of one stored KV head and split are neighbours in the
# grid's x order (decode_impl::block_split / split_grid), so the second block of a GQA-16 pair reads
# the rows the first brought into L2 ("new"; h2's "new" build, 6bb8dbe, is the reference: both
# binaries did not fit one call's 64 MiB beside the engine test). The decode tests,
# the op harness's decode cases (GQA 1-32), the cache and engine tests (the shipped model's group
# of 3 takes kv_rep 3), memcheck of the decode harness's small table; the decode benchmark at
# H_q 32, 64 and 128 (batch 8) twice, SDPA beside it at H_q 128 and 32.
here=$(cd "$(dirname "$0")" && pwd)
root=$(pwd)
o=$OUT
export PATH=$PATH:/usr/local/cuda/bin
w=/tmp/h3
rm -rf $w && mkdir -p $w && tar xJf "$root/carry-h3/h3.txz" -C $w
export LD_LIBRARY_PATH=$w/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
for d in /usr/local/cuda/lib64 /opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib; do
  [ -e "$d/libcublas.so.13" ] && LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$d
done
export VQ_SOURCE_DIR=$root VQ_MODEL_DIR=$root/models/vq-mini-llama
cd $w
exec > >(tee -a "$o/run.txt") 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
t() {  # label, limit, command...
  local label=$1 limit=$2; shift 2
  SECONDS=0; timeout "$limit" "$@" >$w/log_$label.txt 2>&1; local rc=$?
  echo "== $label rc=$rc ${SECONDS}s"
  grep -E "^\[(  FAILED|  PASSED)|worst|FAILED TEST|tests ran" $w/log_$label.txt | head -16
  [ $rc -eq 0 ] || grep -B3 -A25 "Failure\|rror" $w/log_$label.txt | head -60
}
t decode 120 ./test_cuda_decode
t decode_batch 120 ./test_cuda_decode_batch
t harness_decode 200 ./test_backend_ops_cuda --gtest_filter='BackendOpsCuda.DecodeAttention'
grep -E "rep=(8|16|32)" $w/log_harness_decode.txt | sort -t'(' -k2 | tail -4
t caches 200 ./test_cuda_caches
t engine 300 ./test_cuda_engine
export VQ_HARNESS=small
SECONDS=0
timeout 150 compute-sanitizer --tool memcheck --error-exitcode 86 --print-limit 20 ./test_backend_ops_cuda \
  --gtest_filter=BackendOpsCuda.DecodeAttention >$w/san.txt 2>&1
echo "== memcheck rc=$? ${SECONDS}s $(grep -E 'ERROR SUMMARY' $w/san.txt | tail -1)"
unset VQ_HARNESS
sel='^\| 8 \| (4096|32768|131072) \| (skvq K4V4 g32|skvq K2V2 g32|skvq K2V2 g128|fp16 full|bf16 full) \|'
for r in 1 2; do
  for hq in 32 64 128; do
    for v in new; do
      SECONDS=0
      timeout 100 $w/$v/cuda_decode_attention --repeats 20 --no-maintenance --batch 8 --hq $hq \
        --csv $w/b_${v}_${hq}_$r.csv >$w/b_${v}_${hq}_$r.txt 2>&1
      echo "== bench hq $hq $v round $r rc=$? ${SECONDS}s"; grep -E "$sel" $w/b_${v}_${hq}_$r.txt
    done
  done
done
for hq in 128 32; do
  cp $w/b_new_${hq}_2.csv $o/bench_new_hq$hq.csv
  SECONDS=0
  (cd $root && PYTHONUNBUFFERED=1 timeout 150 python3 tools/bench_sdpa.py $o/bench_new_hq$hq.csv --repeats 20 \
    --skip-prefill --hq $hq --shapes 8x4096,8x32768,8x131072 >$w/sdpa_hq$hq.txt 2>&1)
  echo "== sdpa hq $hq rc=$? ${SECONDS}s"
  sed -n '/^| batch/,$p' $w/sdpa_hq$hq.txt | grep -E "^\| (batch|---|8 )" | grep -vE "snapkv|bf16 rows" | head -40
done
