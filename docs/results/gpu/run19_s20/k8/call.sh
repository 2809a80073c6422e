#!/usr/bin/env bash
# s20 call k8 (review): both tensor-core blocks take their packed values through one LaneValues
# (decode_attention_mma.cuh) instead of two copies of the same loads, permutes and fmas (the
# same instructions per warp-tile in the SASS): the decode tests and the op harness.
root=$(pwd)
o=$OUT
w=/tmp/k8
rm -rf $w && mkdir -p $w && tar xJf "$root/carry-k8/gpu.txz" -C $w
export LD_LIBRARY_PATH=$w/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
cd $w
mkdir -p res
exec > >(tee -a "$w/res/run.txt") 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
for t in test_cuda_decode test_cuda_decode_batch; do
  timeout 150 ./$t >res/$t.txt 2>&1; echo "$t rc=$?"; grep -E "^\[  (PASSED|FAILED) " res/$t.txt
done
timeout 200 ./test_backend_ops_cuda >res/test_backend_ops_cuda.txt 2>&1; echo "harness rc=$?"
grep -E "decode_attention \[|prefill_attention \[|FAILED|PASSED" res/test_backend_ops_cuda.txt | tail -4
tar czf $o/k8.tgz res
