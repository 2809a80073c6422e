#!/usr/bin/env bash
# s18 call i6 (issue 14): i5's CudaDecodeBatch.BatchedEqualsOneAtATimeGroup16 found plans of one
# shape and kernel that differ in kv_rep (blocks of 8 or the 16-head block) sharing a batched
# launch; decode_api.cpp's same_instance now keys on kv_rep too. The batched decode test and the
# engine test again.
root=$(pwd)
o=$OUT
w=/tmp/i6
rm -rf $w && mkdir -p $w && tar xJf "$root/carry-i6/gpu.txz" -C $w
export LD_LIBRARY_PATH=$w/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
for d in /usr/local/cuda/lib64 /opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib; do
  [ -e "$d/libcublas.so.13" ] && LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$d
done
export VQ_SOURCE_DIR=$root
cd $w
exec > >(tee -a "$o/run.txt") 2>&1
for t in test_cuda_decode_batch test_cuda_engine; do
  SECONDS=0; timeout 300 ./$t >$w/log_$t.txt 2>&1; rc=$?
  echo "== $t rc=$rc ${SECONDS}s"
  grep -E "^\[(  FAILED|  PASSED|       OK)|FAILED TEST" $w/log_$t.txt | head -30
  [ $rc -eq 0 ] || grep -B3 -A25 "Failure\|rror" $w/log_$t.txt | head -60
done
