#!/usr/bin/env bash
# s15 call f1b: the tests of call f1 again (f1's run.txt did not come back: more than 8 files).
here=$(cd "$(dirname "$0")" && pwd)
o=$OUT
w=/tmp/f1
[ -x $w/kern/test_cuda_decode ] || { rm -rf $w && mkdir -p $w && tar xJf "$here/f1.txz" -C $w; }
export LD_LIBRARY_PATH=$w/kern/lib
cd $w/kern
exec > >(tee -a "$o/run.txt") 2>&1
t() {
  local label=$1 limit=$2; shift 2
  SECONDS=0; timeout "$limit" "$@" >$w/log_$label.txt 2>&1; local rc=$?
  echo "== $label rc=$rc ${SECONDS}s"
  grep -E "^\[(  FAILED|  PASSED)|worst|FAILED TEST|tests ran" $w/log_$label.txt | head -12
  [ $rc -eq 0 ] || grep -B3 -A15 "Failure" $w/log_$label.txt | head -60
}
t decode 120 ./test_cuda_decode
t harness 200 ./test_backend_ops_cuda --gtest_filter='BackendOpsCuda.DecodeAttention*'
export VQ_HARNESS=small
SECONDS=0
timeout 150 compute-sanitizer --tool memcheck --error-exitcode 86 --print-limit 20 ./test_backend_ops_cuda \
  --gtest_filter=BackendOpsCuda.DecodeAttention >$w/san.txt 2>&1
echo "== memcheck rc=$? ${SECONDS}s $(grep -E 'ERROR SUMMARY' $w/san.txt | tail -1)"
