#!/usr/bin/env bash
# s11 call 1: per-instruction profile (ncu source counters, SASS) of the packed decode kernels at
# 8 x 32K on main's kernels (6b7b32c), and the decode bench at batch 8 (the baseline). The second
# command of the call turned each report's source page into prof_*.txt (instruction index,
# instructions executed per warp, stall samples, SASS), packed in prof_source_counters.txz.
here=$(cd "$(dirname "$0")" && pwd)
o=$OUT
rm -rf /tmp/p1 && mkdir -p /tmp/p1 && cp -r "$here/base/lib" /tmp/p1/ && xz -dc "$here/base/cuda_decode_attention.xz" >/tmp/p1/bench && chmod +x /tmp/p1/bench
export LD_LIBRARY_PATH=/tmp/p1/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
cd /tmp/p1
timeout 120 ./bench --batch 8 --context 32768 --repeats 20 --no-maintenance >$o/bench_8x32k.txt 2>&1
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
for m in "skvq K2V2 g32" "skvq K4V4 g32"; do
  n=$(echo "$m" | tr -dc 'A-Za-z0-9')
  timeout 150 "$ncu" --clock-control none -k regex:decode_mma_kernel -c 1 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
    --section WarpStateStats --section InstructionStats --section SourceCounters \
    -o /tmp/p1/rep_$n ./bench --only "$m" --batch 8 --context 32768 --repeats 3 --no-maintenance
  "$ncu" -i /tmp/p1/rep_$n.ncu-rep --page details >$o/ncu_$n.txt 2>&1
  "$ncu" -i /tmp/p1/rep_$n.ncu-rep --page source --csv --print-source sass >/tmp/p1/src_$n.csv
  python3 -c "
import csv,sys
r=list(csv.reader(open('/tmp/p1/src_$n.csv'))); h=r[1]
i_src,i_ex,i_s=h.index('Source'),h.index('Instructions Executed'),h.index('Warp Stall Sampling (All Samples)')
with open('$o/prof_$n.txt','w') as f:
    for k,row in enumerate(r[2:]): f.write('%d\t%s\t%s\t%s\n'%(k,row[i_ex],row[i_s],row[i_src].strip()))"
done
