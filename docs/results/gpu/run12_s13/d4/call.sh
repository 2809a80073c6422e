#!/usr/bin/env bash
# s13 call 4: the CUDA backend's two SnapKV selections share one scoring frame (a refactor after
# d2): the programs that select on the device (caches, the op harness, snapkv) and memcheck.
here=$(cd "$(dirname "$0")" && pwd)
root=$(pwd)
o=$OUT
export PATH=$PATH:/usr/local/cuda/bin
rm -rf /tmp/d4 && mkdir -p /tmp/d4 && tar xJf "$here/gpu.txz" -C /tmp/d4
export LD_LIBRARY_PATH=/tmp/d4/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export VQ_SOURCE_DIR=$root VQ_MODEL_DIR=$root/models/vq-mini-llama
cd /tmp/d4
exec > >(tee -a "$o/run.txt") 2>&1
for p in test_cuda_caches test_backend_ops_cuda test_cuda_snapkv; do
  SECONDS=0; timeout 200 ./$p >/tmp/d4/log_$p.txt 2>&1; rc=$?
  echo "== $p rc=$rc ${SECONDS}s"
  grep -E "^\[(  FAILED|  PASSED)|worst|Failure|FAILED TEST|snap_se" /tmp/d4/log_$p.txt | head -24
done
SECONDS=0
timeout 150 compute-sanitizer --tool memcheck --error-exitcode 86 --print-limit 20 \
  ./test_cuda_caches --gtest_filter='CudaCaches.SkvqProtect*:CudaCaches.SnapKV*' >/tmp/d4/san.txt 2>&1
echo "== memcheck test_cuda_caches SkvqProtect, SnapKV rc=$? ${SECONDS}s $(grep -E 'ERROR SUMMARY' /tmp/d4/san.txt | tail -1) $(grep -E '^\[  PASSED' /tmp/d4/san.txt)"
