#!/usr/bin/env bash
# s12 call 4: compute-sanitizer memcheck and racecheck over the channel-axis cache test
# (tests/cuda/test_cuda_caches.cpp ChannelAxisKeysMatchCpu: device flush, decode, prefill, state)
# and memcheck over the op harness's channel-axis quantizer cases, with call 3's bundle.
here=$(cd "$(dirname "$0")" && pwd)
root=$(pwd)
o=$OUT
export PATH=$PATH:/usr/local/cuda/bin
rm -rf /tmp/c4 && mkdir -p /tmp/c4 && tar xJf "$here/gpu.txz" -C /tmp/c4
export LD_LIBRARY_PATH=/tmp/c4/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export VQ_SOURCE_DIR=$root VQ_MODEL_DIR=$root/models/vq-mini-llama
cd /tmp/c4
exec > >(tee -a "$o/run.txt") 2>&1
./test_cuda_caches --gtest_list_tests | grep -i chan
for tool in memcheck racecheck; do
  SECONDS=0
  timeout 200 compute-sanitizer --tool $tool --error-exitcode 86 --print-limit 20 ./test_cuda_caches \
    --gtest_filter='*Channel*' >/tmp/c4/san_$tool.txt 2>&1
  echo "== $tool test_cuda_caches *Channel* rc=$? ${SECONDS}s $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' /tmp/c4/san_$tool.txt | tail -1) $(grep -E '^\[  (PASSED|FAILED)' /tmp/c4/san_$tool.txt)"
  grep -m5 -E "Invalid|Race|hazard" /tmp/c4/san_$tool.txt
done
export VQ_HARNESS=small
SECONDS=0
timeout 120 compute-sanitizer --tool memcheck --error-exitcode 86 --print-limit 20 ./test_backend_ops_cuda \
  --gtest_filter='BackendOpsCuda.SkvqQuantize*' >/tmp/c4/san_q.txt 2>&1
echo "== memcheck quantizer rc=$? ${SECONDS}s $(grep -E 'ERROR SUMMARY' /tmp/c4/san_q.txt | tail -1) $(grep -E '^\[  (PASSED|FAILED)' /tmp/c4/san_q.txt)"
