#!/usr/bin/env bash
# s20 call k6 (issue 14): the tensor-core blocks' prologue: the zero-point chunk sums read with a
# per-thread rotation (decode_impl::chunk_sum: 32 banks instead of one, the 16- to 32-way
# conflicts ncu counted in k3) and skipped for blocks of f16 rows, which never use them. (1) decode
# test, batched decode test, op harness; (2) A/B timing against k3's build (cda_k3, 19481bd),
# interleaved twice, read flush: H_q 32 at batch 1 and 8, H_q 128 at batch 1 and 8.
root=$(pwd)
o=$OUT
w=/tmp/k6
rm -rf $w && mkdir -p $w && tar xJf "$root/carry-k6/gpu.txz" -C $w
export LD_LIBRARY_PATH=$w/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
cd $w
mkdir -p res
exec > >(tee -a "$w/res/run.txt") 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
for t in test_cuda_decode test_cuda_decode_batch; do
  timeout 150 ./$t >res/$t.txt 2>&1; echo "$t rc=$?"; grep -E "^\[  (PASSED|FAILED) " res/$t.txt
done
timeout 200 ./test_backend_ops_cuda >res/test_backend_ops_cuda.txt 2>&1; echo "harness rc=$?"
grep -E "decode_attention|prefill_attention|FAILED|PASSED" res/test_backend_ops_cuda.txt | tail -4
for rep in 1 2; do
  for v in cda cda_k3; do
    for cfg in "32 1" "32 8" "128 1" "128 8"; do
      set -- $cfg
      timeout 100 ./$v --repeats 20 --no-maintenance --hq $1 --batch $2 >res/${v}_hq$1_B$2_$rep.txt 2>&1
      echo "== $v hq $1 B $2 rep $rep rc=$?"
      grep -E "^\| $2 \| (4096|32768|131072) \| (fp16 full|skvq K2V2 g32|skvq K4V4 g32) " res/${v}_hq$1_B$2_$rep.txt
    done
  done
done
tar czf $o/k6.tgz res
