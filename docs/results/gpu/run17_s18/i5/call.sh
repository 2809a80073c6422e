#!/usr/bin/env bash
# s18 call i5 (issue 14): the planner's rule for the 16-head block (rows always; packed views from
# B * H_kv * rows >= 2^18, DecodePlanOptions::heads_per_block to force either way). The decode
# tests (a batched launch at a group of 16: CudaDecodeBatch.BatchedEqualsOneAtATimeGroup16), the op
# harness's decode cases (groups of 16 also with the 16-head block forced), the engine test,
# memcheck of the harness's small decode table; the decode benchmark at H_q 128 beside SDPA bf16
# and FlashInfer 0.6.18 (the README's GQA-16 table).
root=$(pwd)
o=$OUT
export PATH=$PATH:/usr/local/cuda/bin
w=/tmp/i5
rm -rf $w && mkdir -p $w && tar xJf "$root/carry-i5/gpu.txz" -C $w
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
  grep -E "^\[(  FAILED|  PASSED)|worst|FAILED TEST|tests ran|heads=16" $w/log_$label.txt | head -30
  [ $rc -eq 0 ] || grep -B3 -A25 "Failure\|rror" $w/log_$label.txt | head -80
}
t decode 120 ./test_cuda_decode
t decode_batch 120 ./test_cuda_decode_batch
t harness_decode 200 ./test_backend_ops_cuda --gtest_filter='BackendOpsCuda.DecodeAttention'
t engine 300 ./test_cuda_engine
export VQ_HARNESS=small
SECONDS=0
timeout 150 compute-sanitizer --tool memcheck --error-exitcode 86 --print-limit 20 ./test_backend_ops_cuda \
  --gtest_filter=BackendOpsCuda.DecodeAttention >$w/san.txt 2>&1
echo "== memcheck rc=$? ${SECONDS}s $(grep -E 'ERROR SUMMARY' $w/san.txt | tail -1)"
unset VQ_HARNESS
rm -rf /tmp/vq-site && mkdir -p /tmp/vq-site && tar xJf "$root/carry-i5/site.txz" -C /tmp/vq-site
hq=128
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
