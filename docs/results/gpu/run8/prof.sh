#!/usr/bin/env bash
# kdec: ncu of the packed decode kernels at 8 x 32K + SASS histogram of their instances.
# usage: prof.sh OUTDIR   (run from /tmp/vq-gpu with the bundle unpacked)
o=$1
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $ncu"
for m in "skvq K2V2 g32" "skvq K4V4 g32"; do
  f=$o/ncu_$(echo "$m" | tr -dc 'A-Za-z0-9').txt
  SECONDS=0
  timeout 150 "$ncu" --clock-control none -k regex:decode_mma_kernel -c 1 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
    --section WarpStateStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    --section InstructionStats --section SourceCounters \
    --metrics 'regex:^smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$' \
    ./cuda_decode_attention --only "$m" --batch 8 --context 32768 --repeats 3 --no-maintenance >"$f" 2>&1
  echo "ncu $m rc=$? ${SECONDS}s"
  grep -E "Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Issue Slots Busy|Eligible Warps|Active Warps Per|No Eligible|Executed Ipc A|Block Limit|Executed Instructions  " "$f" | head -24
  grep -E "smsp__average_warps_issue_stalled" "$f" | awk '{print $NF, $1}' | sort -rn | head -8
done
cub=$(command -v cuobjdump || ls /usr/local/cuda/bin/cuobjdump 2>/dev/null | head -1)
if [ -n "$cub" ]; then
  "$cub" -sass ./cuda_decode_attention >"$o/all.sass" 2>/dev/null
  awk -v o="$o" '
    /Function :/ { keep = ($0 ~ /decode_mma_kernelILi128ELi4ELi3ELi[24]ELb0E/); if (keep) { n++; f = o "/sass_" n ".txt"; print > f } next }
    keep { print >> f }' "$o/all.sass"
  for f in "$o"/sass_*.txt; do
    head -1 "$f"
    grep -oE '^\s+/\*[0-9a-f]{4}\*/\s+(@!?U?P[0-9T] )?[A-Z][A-Z0-9_.]*' "$f" | awk '{print $NF}' | sed 's/\..*//' | sort | uniq -c | sort -rn | head -25 | tr '\n' ' '
    echo
    echo "total $(grep -cE '^\s+/\*[0-9a-f]{4}\*/' "$f")"
  done
  rm -f "$o/all.sass"
fi
