#!/usr/bin/env bash
# s19 call j3b (issue 14): (1) the any-bits decode instance against main's dequantize-first
# fallback for K3V3 and K1.5V2 g32 (cda: this tree; cda_old: the same benchmark linked with
# main's kernels); (2) where batch-1 decode time goes: cda_nc is cda without the combine kernel
# (wrong outputs, timing only): its time is the split kernel's alone. Interleaved, twice, H_q 32.
root=$(pwd)
o=$OUT
w=/tmp/j3b
rm -rf $w && mkdir -p $w && tar xJf "$root/carry-j3b/gpu.txz" -C $w
export LD_LIBRARY_PATH=$w/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
cd $w
mkdir -p res
exec > >(tee -a "$w/res/run.txt") 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
for rep in 1 2; do
  for v in cda cda_old; do
    for m in "skvq K3V3 g32" "skvq K1.5V2 g32"; do
      timeout 120 ./$v --repeats 20 --no-maintenance --hq 32 --only "$m" >res/fmt_${v}_${m// /_}_$rep.txt 2>&1
      echo "== $v $m $rep rc=$?"; grep -E "^\| (1|8) \|" res/fmt_${v}_${m// /_}_$rep.txt
    done
  done
  for v in cda cda_nc; do
    for B in 1 8; do
      timeout 120 ./$v --repeats 30 --no-maintenance --hq 32 --batch $B >res/nc_${v}_B${B}_$rep.txt 2>&1
      echo "== $v B $B $rep rc=$?"
      grep -E "^\| $B \| (4096|32768) \| (fp16 full|skvq K2V2 g32|skvq K4V4 g32|snapkv b2048) " res/nc_${v}_B${B}_$rep.txt
    done
  done
done
tar czf $o/j3b.tgz res
