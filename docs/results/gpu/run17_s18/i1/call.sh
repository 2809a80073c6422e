#!/usr/bin/env bash
# s18 call i1 (issue 14): a GQA group of 16 in one block with the heads in the mma's M dimension
# (src/cuda/decode_attention_mma16.cuh; f16 and bf16 rows, plan kv_rep 1 instead of 2 blocks of
# 8). The decode tests, the op harness's decode cases (section 6: GQA 16 / 32 rows f16 and bf16),
# the cache tests, memcheck of the harness's small decode table; the decode benchmark at H_q 128
# (GQA 16) and H_q 32 (GQA 4, unchanged kernels: the control) beside SDPA bf16 and FlashInfer
# 0.6.18 (its JIT kernels built once before timing). Everything in run.txt.
root=$(pwd)
o=$OUT
export PATH=$PATH:/usr/local/cuda/bin
w=/tmp/i1
rm -rf $w && mkdir -p $w && tar xJf "$root/carry-i1/gpu.txz" -C $w
export LD_LIBRARY_PATH=$w/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export VQ_SOURCE_DIR=$root
cd $w
exec > >(tee -a "$o/run.txt") 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
t() {  # label, limit, command...
  local label=$1 limit=$2; shift 2
  SECONDS=0; timeout "$limit" "$@" >$w/log_$label.txt 2>&1; local rc=$?
  echo "== $label rc=$rc ${SECONDS}s"
  grep -E "^\[(  FAILED|  PASSED)|worst|FAILED TEST|tests ran|rep=(3|6|12|16|32)" $w/log_$label.txt | head -24
  [ $rc -eq 0 ] || grep -B3 -A25 "Failure\|rror" $w/log_$label.txt | head -80
}
t decode 120 ./test_cuda_decode
t decode_batch 120 ./test_cuda_decode_batch
t harness_decode 200 ./test_backend_ops_cuda --gtest_filter='BackendOpsCuda.DecodeAttention'
grep -E "decode_attention.*cases|G(16|32)|gqa" $w/log_harness_decode.txt | head -20
t caches 200 ./test_cuda_caches
export VQ_HARNESS=small
SECONDS=0
timeout 150 compute-sanitizer --tool memcheck --error-exitcode 86 --print-limit 20 ./test_backend_ops_cuda \
  --gtest_filter=BackendOpsCuda.DecodeAttention >$w/san.txt 2>&1
echo "== memcheck rc=$? ${SECONDS}s $(grep -E 'ERROR SUMMARY' $w/san.txt | tail -1)"
unset VQ_HARNESS
rm -rf /tmp/vq-site && mkdir -p /tmp/vq-site && tar xJf "$root/carry-i1/site.txz" -C /tmp/vq-site
for hq in 128 32; do
  SECONDS=0; timeout 150 ./cuda_decode_attention --repeats 20 --no-maintenance --hq $hq \
    --csv $o/bench_hq$hq.csv >$o/decode_hq$hq.txt 2>&1
  echo "== bench hq $hq rc=$? ${SECONDS}s"
  SECONDS=0
  (cd $root && PYTHONUNBUFFERED=1 timeout 150 python3 tools/bench_sdpa.py $o/bench_hq$hq.csv --repeats 20 \
    --skip-prefill --hq $hq >$o/sdpa_hq$hq.txt 2>&1)
  echo "== sdpa hq $hq rc=$? ${SECONDS}s"
  SECONDS=0
  (cd $root && PYTHONPATH=/tmp/vq-site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 \
    FLASHINFER_WORKSPACE_BASE=/tmp/vq-fi FLASHINFER_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 \
    timeout 300 python3 tools/bench_flashinfer.py $o/bench_hq$hq.csv --repeats 20 --hq $hq \
    >$o/flashinfer_hq$hq.txt 2>&1)
  echo "== flashinfer hq $hq rc=$? ${SECONDS}s"
  grep -E "^JIT|not importable|rror" $o/flashinfer_hq$hq.txt | head -5
  grep -E "^\| (1|8) \| (4096|32768|131072) \| (torch SDPA|FlashInfer|fp16 full|bf16 full|skvq K2V2 g32|skvq K4V4 g32) " \
    $o/flashinfer_hq$hq.txt | head -60
done
