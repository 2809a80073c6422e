#!/usr/bin/env bash
# s12 call 6: the op harness's quantizer tests with their setup in one helper (quant_setup in
# tests/cuda/test_backend_ops_cuda.cpp; duplicates D1): token- and channel-axis cases byte-exact.
here=$(cd "$(dirname "$0")" && pwd)
root=$(pwd)
rm -rf /tmp/c6 && mkdir -p /tmp/c6 && tar xJf "$here/gpu.txz" -C /tmp/c6
export LD_LIBRARY_PATH=/tmp/c6/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export VQ_SOURCE_DIR=$root
cd /tmp/c6
./test_backend_ops_cuda --gtest_filter='BackendOpsCuda.SkvqQuantize*' 2>&1 | grep -E "cases|^\[  (PASSED|FAILED)|Failure" | tee $OUT/run.txt
