#!/usr/bin/env bash
# s16 call g3 (issue 14): where the wgmma prefill kernel's time goes. The benchmark at 32K f16
# rows with diagnostic variants (VQ_PREFILL_WG_DIAG: 1 no softmax arithmetic, 2 no staging after
# the first tiles, 3 both; their outputs are wrong by design, timing only), ncu with warp-state,
# instruction and source-level stall sections of the normal kernel, and its SASS.
root=$(pwd)
o=$OUT
export PATH=$PATH:/usr/local/cuda/bin
w=/tmp/g3
rm -rf $w && mkdir -p $w && tar xJf "$root/carry-g3/g3.txz" -C $w
export LD_LIBRARY_PATH=$w/wg/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
cd $w/wg
exec > >(tee -a "$o/run.txt") 2>&1
for r in 1 2; do for d in 0 1 2 3; do
  SECONDS=0
  VQ_PREFILL_WG_DIAG=$d ./cuda_prefill_attention --repeats 5 --skip-snapkv --skip-bf16 >$w/b.txt 2>&1
  echo "== diag $d round $r rc=$? ${SECONDS}s"; grep -E "^\| (4096|32768) \| f16 rows" $w/b.txt
done; done
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
SECONDS=0
timeout 150 "$ncu" --clock-control none -k regex:prefill_wg -s 3 -c 1 --section SpeedOfLight \
  --section Occupancy --section SchedulerStats --section WarpStateStats --section InstructionStats \
  --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section SourceCounters \
  ./cuda_prefill_attention --repeats 1 --skip-snapkv --skip-bf16 --context 32768 >$o/ncu.txt 2>&1
echo "== ncu rc=$? ${SECONDS}s"
cuo=$(command -v cuobjdump || ls /usr/local/cuda/bin/cuobjdump 2>/dev/null | head -1)
if [ -n "$cuo" ]; then
  "$cuo" -sass ./cuda_prefill_attention 2>/dev/null | awk '/Function : .*prefill_wg_kernelILi128E6__halfELi0E/{f=1} f&&/Function : /&&!/prefill_wg_kernelILi128E6__halfELi0E/{f=0} f' >$o/sass.txt
  echo "== sass lines $(wc -l <$o/sass.txt)"
else
  echo "== no cuobjdump"
fi
