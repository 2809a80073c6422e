#!/usr/bin/env bash
# s19 call j3a (issue 14): codes of any spec decoded in place (the CUDA-core kernel's any-bits
# instance, decode_attention_kany.cu: 3-bit, 1.5-bit, 5/6-bit codes and bit pairs such as (2,8),
# (8,1) no longer dequantized first). The decode, batched-decode and cache tests, the op
# harness (decode and prefill over the packed formats, 6 new ones), memcheck of the harness's
# small decode table; the decode benchmark at H_q 32 and 128 (read flush).
root=$(pwd)
o=$OUT
w=/tmp/j3a
rm -rf $w && mkdir -p $w && tar xJf "$root/carry-j3a/gpu.txz" -C $w
export LD_LIBRARY_PATH=$w/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
for d in /usr/local/cuda/lib64 /opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib; do
  [ -e "$d/libcublas.so.13" ] && LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$d
done
export VQ_SOURCE_DIR=$root PATH=$PATH:/usr/local/cuda/bin
cd $w
mkdir -p res
exec > >(tee -a "$w/res/run.txt") 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
t() {  # label, limit, command...
  local label=$1 limit=$2; shift 2
  SECONDS=0; timeout "$limit" "$@" >res/log_$label.txt 2>&1; local rc=$?
  echo "== $label rc=$rc ${SECONDS}s"
  grep -E "^\[(  FAILED|  PASSED)|FAILED TEST|tests ran|worst" res/log_$label.txt | head -30
  [ $rc -eq 0 ] || grep -B3 -A25 "Failure\|rror" res/log_$label.txt | head -80
}
t decode 120 ./test_cuda_decode
t decode_batch 120 ./test_cuda_decode_batch
t harness 400 ./test_backend_ops_cuda
t caches 300 ./test_cuda_caches
export VQ_HARNESS=small
SECONDS=0
timeout 200 compute-sanitizer --tool memcheck --error-exitcode 86 --print-limit 20 ./test_backend_ops_cuda \
  --gtest_filter=BackendOpsCuda.DecodeAttention >res/san.txt 2>&1
echo "== memcheck rc=$? ${SECONDS}s $(grep -E 'ERROR SUMMARY' res/san.txt | tail -1)"
unset VQ_HARNESS
for hq in 32 128; do
  SECONDS=0; timeout 150 ./cda --repeats 20 --no-maintenance --hq $hq --csv res/bench_hq$hq.csv \
    >res/decode_hq$hq.txt 2>&1
  echo "== bench hq $hq rc=$? ${SECONDS}s"
  grep -E "K3V3|K1.5V2" res/decode_hq$hq.txt
done
tar czf $o/j3a.tgz res
