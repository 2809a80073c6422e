#!/usr/bin/env bash
# kdec's branch on the device (its own call did not fit its allowance): the decode programs of
# carry-kdec/c1 (VQ_BUNDLE=decode of s9-kdec-gqa16 = s9-kdec + GQA 16): decode tests and the op
# harness's decode cases, then the decode benchmark at batch 8.
o=$OUT/kdec; mkdir -p $o
rm -rf /tmp/vq-gpu && mkdir -p /tmp/vq-gpu && tar xJf carry-kdec/c1/gpu.txz -C /tmp/vq-gpu
export LD_LIBRARY_PATH=/tmp/vq-gpu/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
cd /tmp/vq-gpu
for t in "test_cuda_decode" "test_cuda_caches" "test_backend_ops_cuda --gtest_filter=BackendOpsCuda.DecodeAttention*"; do
  SECONDS=0
  timeout 150 ./$t >$o/$(echo $t | cut -d' ' -f1).txt 2>&1; rc=$?
  echo "$t rc=$rc ${SECONDS}s" >>$o/run.txt
  grep -E "^\[(  FAILED|  PASSED)|worst|Failure" $o/$(echo $t | cut -d' ' -f1).txt | head -12 >>$o/run.txt
done
SECONDS=0; timeout 100 ./cuda_decode_attention --batch 8 --repeats 20 --no-maintenance >$o/bench_b8.txt 2>&1
echo "bench rc=$? ${SECONDS}s" >>$o/run.txt
