#!/usr/bin/env bash
# s26 call n1 (issue 14): main's decode kernels (f7a9328, CUDA unchanged since session 24) on this
# card: (1) the decode benchmark at H_q 32 and 128 with PyTorch SDPA beside it (read flush);
# (2) ncu --set full of the K2V2 g32 and K4V4 g32 split kernels at 8 x 32K, H_q 32 (where the
# packed kernels stall); (3) planner sweeps: K2V2 g32 8 x 32K over stage bytes and target blocks,
# fp16 1 x 4K over target blocks (the batch-1 target).
root=$(pwd)
o=$OUT
w=/tmp/n1
rm -rf $w && mkdir -p $w && tar xJf "$root/carry-n1/gpu.txz" -C $w
export LD_LIBRARY_PATH=$w/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PATH=$PATH:/usr/local/cuda/bin
cd $w
mkdir -p res
exec > >(tee -a "$w/res/run.txt") 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,clocks.max.sm --format=csv,noheader
for hq in 32 128; do
  SECONDS=0
  timeout 150 ./cda --repeats 20 --no-maintenance --hq $hq --csv res/bench_hq$hq.csv >res/decode_hq$hq.txt 2>&1
  echo "== bench hq $hq rc=$? ${SECONDS}s"
  SECONDS=0
  (cd $root && PYTHONUNBUFFERED=1 timeout 150 python3 tools/bench_sdpa.py $w/res/bench_hq$hq.csv \
    --repeats 20 --skip-prefill --hq $hq >$w/res/sdpa_hq$hq.txt 2>&1)
  echo "== sdpa hq $hq rc=$? ${SECONDS}s"
  grep -E "^\| (1|8) \| (4096|32768|131072) \| (torch SDPA|fp16 full|skvq K2V2 g32|skvq K4V4 g32) " res/sdpa_hq$hq.txt
done
echo "== sweep K2V2 g32 8 x 32K (stage bytes, target blocks)"
for sb in 0 6144 12288 24576; do
  for tb in 0 1056 2112; do
    r=$(timeout 40 ./cda --repeats 20 --no-maintenance --batch 8 --context 32768 --only "skvq K2V2 g32" \
      --packed-stage-bytes $sb --target-blocks $tb 2>&1 | grep -E "^\| 8 \| 32768 \| skvq K2V2 g32 ")
    echo "sb $sb tb $tb $r"
  done
done
echo "== sweep fp16 / K2V2 g32 1 x 4K (target blocks)"
for m in "fp16 full" "skvq K2V2 g32"; do
  for tb in 0 64 128 256 512 1024; do
    r=$(timeout 40 ./cda --repeats 30 --no-maintenance --batch 1 --context 4096 --only "$m" \
      --target-blocks $tb 2>&1 | grep -E "^\| 1 \| 4096 \| $m ")
    echo "tb $tb $r"
  done
done
for m in "skvq K2V2 g32" "skvq K4V4 g32"; do
  n=$(echo $m | tr -d ' ')
  SECONDS=0
  timeout 120 ncu --set full -k regex:decode_mma_kernel --launch-skip 3 --launch-count 1 \
    -o res/ncu_$n ./cda --repeats 2 --no-maintenance --batch 8 --context 32768 --only "$m" \
    >res/ncu_${n}_log.txt 2>&1
  echo "== ncu $m rc=$? ${SECONDS}s"
  ncu --import res/ncu_$n.ncu-rep --print-details all >res/ncu_$n.txt 2>&1
  grep -E "Duration|Executed Instructions |Issue Slots Busy|Eligible Warps|Active Warps Per|No Eligible|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit|Stall|Memory Throughput|DRAM Throughput" res/ncu_$n.txt | sed 's/  */ /g' | head -40
done
ncu --import res/ncu_skvqK2V2g32.ncu-rep --page raw --print-units base 2>/dev/null | grep -E "smsp__average_warp(s)?_issue_stalled|smsp__pcsamp_warps_issue_stalled" | sed 's/  */ /g' | sort -k3 -g -r | head -40 >res/stalls_k2v2.txt
cat res/stalls_k2v2.txt | head -30
tar czf $o/n1.tgz res
