#!/usr/bin/env bash
# s20 call k2 (issue 14): why k1's lane-unit map was slower at 8 x 4K, H_q 128 (77.6 against
# 64.6 us) and neutral at 8 x 32K, H_q 32: ncu of the K2V2 g32 split kernel, this tree (cda)
# against main (cda_old), one launch each after warm-up.
root=$(pwd)
o=$OUT
w=/tmp/k1
[ -x $w/cda ] || { rm -rf $w && mkdir -p $w && tar xJf "$root/carry-k1/gpu.txz" -C $w; }
export LD_LIBRARY_PATH=$w/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
cd $w
mkdir -p res2
exec > >(tee -a "$w/res2/run.txt") 2>&1
m=gpu__time_duration.sum,smsp__inst_executed.sum,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum,smsp__warp_issue_stalled_short_scoreboard_per_warp_active.pct,smsp__warp_issue_stalled_long_scoreboard_per_warp_active.pct,smsp__warp_issue_stalled_barrier_per_warp_active.pct,smsp__warp_issue_stalled_wait_per_warp_active.pct,smsp__warp_issue_stalled_mio_throttle_per_warp_active.pct,smsp__warp_issue_stalled_math_pipe_throttle_per_warp_active.pct,smsp__warps_eligible.avg.per_cycle_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__registers_per_thread,launch__grid_size,l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum
for v in cda cda_old; do
  for cfg in "128 4096" "32 32768"; do
    set -- $cfg
    echo "== $v hq $1 ctx $2"
    timeout 120 ncu --metrics $m -k regex:decode_mma_kernel --launch-skip 3 --launch-count 1 \
      ./$v --repeats 2 --no-maintenance --hq $1 --batch 8 --context $2 --only "skvq K2V2 g32" \
      >res2/ncu_${v}_hq$1_$2.txt 2>&1
    echo "rc=$?"
    grep -E "decode_mma_kernel|duration|inst_executed|warps_active|issue_active|bank_conflicts|stalled|eligible|dram__|registers|grid_size|local" res2/ncu_${v}_hq$1_$2.txt | sed 's/  */ /g' | cut -c1-150
  done
done
tar czf $o/k2.tgz res2
