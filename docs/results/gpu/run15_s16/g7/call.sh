#!/usr/bin/env bash
# s16 call g7 (issues 14, 13): main's build after the wgmma prefill kernel landed (28b528f): the
# op harness's prefill cases through both kernels (wgmma by default, then VQ_PREFILL_MMA_SYNC=1),
# the prefill, device-cache and SnapKV tests, and the prefill benchmark once per kernel.
root=$(pwd)
o=$OUT
export PATH=$PATH:/usr/local/cuda/bin
w=/tmp/g7
rm -rf $w && mkdir -p $w && tar xJf "$root/carry-g7/g7.txz" -C $w
export LD_LIBRARY_PATH=$w/wg/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export VQ_SOURCE_DIR=$root VQ_MODEL_DIR=$root/models/vq-mini-llama
cd $w/wg
exec > >(tee -a "$o/run.txt") 2>&1
t() {
  local label=$1 limit=$2; shift 2
  SECONDS=0; timeout "$limit" "$@" >$w/log_$label.txt 2>&1; local rc=$?
  echo "== $label rc=$rc ${SECONDS}s"
  grep -E "^\[(  FAILED|  PASSED)|worst|FAILED TEST|tests ran|prefill_attention" $w/log_$label.txt | head -12
  [ $rc -eq 0 ] || grep -B3 -A25 "Failure\|rror" $w/log_$label.txt | head -60
}
t harness 150 ./test_backend_ops_cuda --gtest_filter='BackendOpsCuda.PrefillAttention'
t prefill 100 ./test_cuda_prefill
t caches 150 ./test_cuda_caches
t snapkv 100 ./test_cuda_snapkv
for v in wg mma; do
  SECONDS=0
  if [ $v = mma ]; then export VQ_PREFILL_MMA_SYNC=1; else unset VQ_PREFILL_MMA_SYNC; fi
  timeout 60 ./cuda_prefill_attention --repeats 5 --skip-snapkv >$w/b_$v.txt 2>&1
  echo "== bench $v rc=$? ${SECONDS}s"; grep -E "^\| (4096|32768)" $w/b_$v.txt
done
