#!/usr/bin/env bash
# s20 call k1 (issue 14): the lane-unit map of f16-metadata packed values (LaneCodes in
# src/cuda/decode_attention_mma.cuh: a lane's code units of a row in one or two loads, its
# (lo, scale) once per warp-tile). (1) correctness: the decode tests and the op harness on this
# tree; (2) A/B timing, interleaved, twice: cda (this tree) against cda_old (main 020c97f), read
# flush, H_q 32 at batch 1 and 8, H_q 128 at batch 8.
root=$(pwd)
o=$OUT
w=/tmp/k1
rm -rf $w && mkdir -p $w && tar xJf "$root/carry-k1/gpu.txz" -C $w
export LD_LIBRARY_PATH=$w/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export VQ_SOURCE_DIR=$root VQ_MODEL_DIR=$root/models/vq-mini-llama
cd $w
mkdir -p res
exec > >(tee -a "$w/res/run.txt") 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
timeout 150 ./test_cuda_decode >res/test_cuda_decode.txt 2>&1; echo "test_cuda_decode rc=$?"; tail -3 res/test_cuda_decode.txt
timeout 200 ./test_backend_ops_cuda >res/test_backend_ops_cuda.txt 2>&1; echo "harness rc=$?"; grep -E "cases|FAILED|PASSED" res/test_backend_ops_cuda.txt | tail -8
for rep in 1 2; do
  for v in cda cda_old; do
    for cfg in "32 1" "32 8" "128 8"; do
      set -- $cfg
      hq=$1 B=$2
      {
        timeout 100 ./$v --repeats 20 --no-maintenance --hq $hq --batch $B >res/${v}_hq${hq}_B${B}_$rep.txt 2>&1
        echo "== $v hq $hq B $B rep $rep rc=$?"
        grep -E "^\| $B \| (4096|32768|131072) \| (fp16 full|skvq K2V2 g32|skvq K4V4 g32) " res/${v}_hq${hq}_B${B}_$rep.txt
      }
    done
  done
done
tar czf $o/k1.tgz res
