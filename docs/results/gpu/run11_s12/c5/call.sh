#!/usr/bin/env bash
# s12 call 5: the token- and channel-axis packers of src/cuda/skvq_flush.cu share one code-byte
# helper (packed_code_byte; duplicates D3): the op harness's quantizer cases (byte-exact against
# the CPU's records) and every device cache test (test_cuda_caches), with that change alone.
here=$(cd "$(dirname "$0")" && pwd)
root=$(pwd)
o=$OUT
rm -rf /tmp/c5 && mkdir -p /tmp/c5 && tar xJf "$here/gpu.txz" -C /tmp/c5
export LD_LIBRARY_PATH=/tmp/c5/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export VQ_SOURCE_DIR=$root VQ_MODEL_DIR=$root/models/vq-mini-llama
cd /tmp/c5
exec > >(tee -a "$o/run.txt") 2>&1
for t in "test_backend_ops_cuda --gtest_filter=BackendOpsCuda.SkvqQuantize*" "test_cuda_caches"; do
  SECONDS=0; timeout 120 ./$t >/tmp/c5/log.txt 2>&1; rc=$?
  echo "== $t rc=$rc ${SECONDS}s"
  grep -E "^\[(  FAILED|  PASSED)|skvq_quantize|Failure|worst" /tmp/c5/log.txt | head -20
done
