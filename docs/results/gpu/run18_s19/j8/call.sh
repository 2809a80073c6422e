#!/usr/bin/env bash
# s19 call j8 (review): the any-bits instance reads three-level codes through packed.h's code_at
# (no reader of its own) and the CUDA-core instance is picked from CodeSpec::bits_x2 (no
# three-level special case): the decode tests, the op harness's decode cases, the benchmark's
# K3V3 and K1.5V2 rows (H_q 32, read flush) against j3a's.
root=$(pwd)
o=$OUT
w=/tmp/j8
rm -rf $w && mkdir -p $w && tar xJf "$root/carry-j8/gpu.txz" -C $w
export LD_LIBRARY_PATH=$w/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export VQ_SOURCE_DIR=$root
cd $w
./test_cuda_decode 2>&1 | grep -E "PASSED|FAILED|worst" | tail -8
./test_backend_ops_cuda --gtest_filter='BackendOpsCuda.DecodeAttention' 2>&1 | grep -E "decode_attention \[|PASSED|FAILED" | tail -4
for m in "skvq K3V3 g32" "skvq K1.5V2 g32" "skvq K4V4 g32"; do
  ./cda --repeats 20 --no-maintenance --hq 32 --only "$m" 2>&1 | grep -E "^\| (1|8) \|"
done | tee $o/bench.txt
