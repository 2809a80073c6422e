#!/usr/bin/env bash
# s11 call 4 (issue 14): decode kernels with 32-bit tile offsets, a running stage/phase and no
# per-row visibility test on fully visible tiles: the decode tests, the op harness's decode cases,
# sanitizer memcheck/racecheck over its small decode table, then the README table: our decode benchmark at batch 1 and 8 beside
# PyTorch SDPA bf16 and FlashInfer 0.6.18 (bf16 and fp8-e4m3 KV, CUDA-core and tensor-core decode;
# JIT built once before timing in one cache folder), all in this call.
here=$(cd "$(dirname "$0")" && pwd)
o=$OUT
export PATH=$PATH:/usr/local/cuda/bin
rm -rf /tmp/c4 && mkdir -p /tmp/c4 && tar xJf "$here/gpu.txz" -C /tmp/c4
export LD_LIBRARY_PATH=/tmp/c4/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
cd /tmp/c4
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader | tee $o/run.txt
st=0
for t in "test_cuda_decode" "test_cuda_decode_batch" "test_cuda_caches" "test_backend_ops_cuda --gtest_filter=BackendOpsCuda.DecodeAttention*"; do
  SECONDS=0
  n=$(echo $t | cut -d' ' -f1)
  timeout 150 ./$t >/tmp/c4/log_$n.txt 2>&1; rc=$?
  [ $rc -eq 0 ] || st=1
  echo "$t rc=$rc ${SECONDS}s" | tee -a $o/run.txt
  grep -E "^\[(  FAILED|  PASSED)|worst|Failure|rep=16" /tmp/c4/log_$n.txt | head -12 | tee -a $o/run.txt
done
export VQ_HARNESS=small
for tool in memcheck racecheck; do
  SECONDS=0
  timeout 60 compute-sanitizer --tool $tool --error-exitcode 86 --print-limit 20 ./test_backend_ops_cuda \
    --gtest_filter=BackendOpsCuda.DecodeAttention >/tmp/san_$tool.txt 2>&1
  echo "sanitizer $tool rc=$? ${SECONDS}s $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' /tmp/san_$tool.txt | tail -1) $(grep -E '^\[  PASSED' /tmp/san_$tool.txt)" | tee -a $o/run.txt
done
unset VQ_HARNESS
SECONDS=0; timeout 100 ./cuda_decode_attention --repeats 20 --no-maintenance --csv $o/bench.csv >$o/decode.txt 2>&1
echo "new bench rc=$? ${SECONDS}s" | tee -a $o/run.txt
grep -E "^\| 8 \| .*(K4V4 g32 \||K2V2 g32 \||K2V2 g128 \||fp16 full)" $o/decode.txt | tee -a $o/run.txt
cp $here/*.py /tmp/c4/
SECONDS=0
PYTHONUNBUFFERED=1 timeout 60 python3 bench_sdpa.py $o/bench.csv --repeats 20 --skip-prefill >$o/sdpa.txt 2>&1
echo "sdpa rc=$? ${SECONDS}s" | tee -a $o/run.txt
SECONDS=0
mkdir -p /tmp/vq-site && tar xJf $here/fi-site.txz -C /tmp/vq-site
export PYTHONPATH=/tmp/vq-site FLASHINFER_WORKSPACE_BASE=/tmp/vq-fi FLASHINFER_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 PYTHONUNBUFFERED=1
SECONDS=0; timeout 200 python3 bench_flashinfer.py $o/bench.csv --repeats 20 --shapes 1x4096,8x32768,8x131072 >$o/fi.txt 2>&1
echo "flashinfer rc=$? ${SECONDS}s" | tee -a $o/run.txt
grep -hE "^JIT|not importable|Error" $o/fi.txt | head | tee -a $o/run.txt
grep -E "^\| 8 \| (32768|131072) " $o/sdpa.txt $o/fi.txt | head -30 | tee -a $o/run.txt
echo "status=$st" | tee -a $o/run.txt
