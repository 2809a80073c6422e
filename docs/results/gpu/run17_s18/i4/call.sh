#!/usr/bin/env bash
# s18 call i4 (issues 14, 13): the 16-head block for packed views too (fixed group-32 records with
# f16 metadata, 2- and 4-bit: decode_attention_mma16.cuh, PK 3), and skvq_protect_scoring=external
# on the device (SkvqCache no longer refuses it there). The decode tests, the op harness's decode
# cases (section 7: GQA 16 / 32 packed views), the cache tests, the eval tests, memcheck of the
# harness's small decode table; the decode benchmark at H_q 128 and H_q 32 (control) beside SDPA
# bf16 and FlashInfer 0.6.18 (JIT kernels built once before timing).
root=$(pwd)
o=$OUT
export PATH=$PATH:/usr/local/cuda/bin
w=/tmp/i4
rm -rf $w && mkdir -p $w && tar xJf "$root/carry-i4/gpu.txz" -C $w
export LD_LIBRARY_PATH=$w/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
for d in /usr/local/cuda/lib64 /opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib; do
  [ -e "$d/libcublas.so.13" ] && LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$d
done
export VQ_SOURCE_DIR=$root
cd $w
exec > >(tee -a "$o/run.txt") 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
t() {  # label, limit, command...
  local label=$1 limit=$2; shift 2
  SECONDS=0; timeout "$limit" "$@" >$w/log_$label.txt 2>&1; local rc=$?
  echo "== $label rc=$rc ${SECONDS}s"
  grep -E "^\[(  FAILED|  PASSED)|worst|FAILED TEST|tests ran|external|rep=(16|32)" $w/log_$label.txt | head -40
  [ $rc -eq 0 ] || grep -B3 -A25 "Failure\|rror" $w/log_$label.txt | head -80
}
t decode 120 ./test_cuda_decode
t decode_batch 120 ./test_cuda_decode_batch
t harness_decode 200 ./test_backend_ops_cuda --gtest_filter='BackendOpsCuda.DecodeAttention'
t caches 300 ./test_cuda_caches
export VQ_HARNESS=small
SECONDS=0
timeout 150 compute-sanitizer --tool memcheck --error-exitcode 86 --print-limit 20 ./test_backend_ops_cuda \
  --gtest_filter=BackendOpsCuda.DecodeAttention >$w/san.txt 2>&1
echo "== memcheck rc=$? ${SECONDS}s $(grep -E 'ERROR SUMMARY' $w/san.txt | tail -1)"
unset VQ_HARNESS
rm -rf /tmp/vq-site && mkdir -p /tmp/vq-site && tar xJf "$root/carry-i4/site.txz" -C /tmp/vq-site
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
  grep -E "^\| (1|8) \| (4096|32768|131072) \| (FlashInfer bf16 tc|FlashInfer fp8 e4m3 tc|fp16 full|skvq K2V2 g32|skvq K4V4 g32) " \
    $o/flashinfer_hq$hq.txt | head -40
done
t eval 400 ./test_cuda_eval
