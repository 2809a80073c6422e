#!/usr/bin/env bash
# s12 call 1 (issue 14): branch s11-kparam's decode kernels (single launches read the kernel
# parameter, batched launches their own instance with staged parameters): decode tests, the op
# harness's decode cases, memcheck/racecheck over its small decode table, the decode benchmark
# beside PyTorch SDPA bf16 and FlashInfer 0.6.18 (bf16 and fp8-e4m3 KV; JIT built once before
# timing), then the cache and engine GPU tests.
here=$(cd "$(dirname "$0")" && pwd)
root=$(pwd)
o=$OUT
export PATH=$PATH:/usr/local/cuda/bin
rm -rf /tmp/c1 && mkdir -p /tmp/c1 && tar xJf "$here/gpu.txz" -C /tmp/c1
export LD_LIBRARY_PATH=/tmp/c1/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
for d in /usr/local/cuda/lib64 /opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib; do
  [ -e "$d/libcublas.so.13" ] && LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$d
done
export VQ_SOURCE_DIR=$root VQ_MODEL_DIR=$root/models/vq-mini-llama
cd /tmp/c1
exec > >(tee -a "$o/run.txt") 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
t() {  # label, limit, command...
  local label=$1 limit=$2; shift 2
  SECONDS=0; timeout "$limit" "$@" >/tmp/c1/log_$label.txt 2>&1; local rc=$?
  echo "== $label rc=$rc ${SECONDS}s"
  grep -E "^\[(  FAILED|  PASSED)|worst|Failure|FAILED TEST|decode_attention \[" /tmp/c1/log_$label.txt | head -12
}
t decode 60 ./test_cuda_decode
t decode_batch 40 ./test_cuda_decode_batch
t harness 60 ./test_backend_ops_cuda --gtest_filter=BackendOpsCuda.DecodeAttention*
export VQ_HARNESS=small
for tool in memcheck racecheck; do
  SECONDS=0
  timeout 60 compute-sanitizer --tool $tool --error-exitcode 86 --print-limit 20 ./test_backend_ops_cuda \
    --gtest_filter=BackendOpsCuda.DecodeAttention >/tmp/c1/san_$tool.txt 2>&1
  echo "== sanitizer $tool rc=$? ${SECONDS}s $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' /tmp/c1/san_$tool.txt | tail -1)"
done
unset VQ_HARNESS
SECONDS=0; timeout 100 ./cuda_decode_attention --repeats 20 --no-maintenance --csv $o/bench.csv >$o/decode.txt 2>&1
echo "== bench rc=$? ${SECONDS}s"
grep -E "^\| (1|8) \| .*(K4V4 g32 \||K2V2 g32 \||fp16 full)" $o/decode.txt
SECONDS=0
PYTHONUNBUFFERED=1 timeout 70 python3 $root/tools/bench_sdpa.py $o/bench.csv --repeats 20 --skip-prefill >$o/sdpa.txt 2>&1
echo "== sdpa rc=$? ${SECONDS}s"
mkdir -p /tmp/vq-site && tar xJf $here/fi-site.txz -C /tmp/vq-site
export PYTHONPATH=/tmp/vq-site FLASHINFER_WORKSPACE_BASE=/tmp/vq-fi FLASHINFER_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 PYTHONUNBUFFERED=1
SECONDS=0; timeout 200 python3 $root/tools/bench_flashinfer.py $o/bench.csv --repeats 20 --shapes 1x4096,8x32768,8x131072 >$o/fi.txt 2>&1
echo "== flashinfer rc=$? ${SECONDS}s"
grep -hE "^JIT|not importable|Error" $o/fi.txt | head
unset PYTHONPATH
t cuda_caches 60 ./test_cuda_caches
t cuda_skvq 40 ./test_cuda_skvq
t cuda_engine 90 ./test_cuda_engine
