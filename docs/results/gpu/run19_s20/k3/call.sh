#!/usr/bin/env bash
# s20 call k3 (issue 14): k1's lane-unit map of f16-metadata packed values (LaneCodes in
# src/cuda/decode_attention_mma.cuh) plus what k2's ncu showed: the tensor-core blocks' merge
# buffer swizzled (merge_slot: k1's merge stores conflicted up to 32-way) and one warp-tile's codes
# live at a time. (3) ncu of the K2V2 g32 split kernel (this tree) at k2's two shapes. (1) correctness: the decode tests and the op harness on this
# tree; (2) A/B timing, interleaved, twice: cda (this tree) against cda_old (main 020c97f), read
# flush, H_q 32 at batch 1 and 8, H_q 128 at batch 8.
root=$(pwd)
o=$OUT
w=/tmp/k3
rm -rf $w && mkdir -p $w && tar xJf "$root/carry-k3/gpu.txz" -C $w
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
m=gpu__time_duration.sum,smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum,smsp__warps_eligible.avg.per_cycle_active,l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum
for v in cda cda_old; do
  for cfg in "128 4096" "32 32768"; do
    set -- $cfg
    echo "== ncu $v hq $1 ctx $2"
    timeout 60 ncu --metrics $m -k regex:decode_mma_kernel --launch-skip 3 --launch-count 1 \
      ./$v --repeats 2 --no-maintenance --hq $1 --batch 8 --context $2 --only "skvq K2V2 g32" \
      >res/ncu_${v}_hq$1_$2.txt 2>&1
    grep -E "duration|inst_executed|issue_active|bank_conflicts|eligible|local" res/ncu_${v}_hq$1_$2.txt | sed 's/  */ /g'
  done
done
tar czf $o/k3.tgz res
