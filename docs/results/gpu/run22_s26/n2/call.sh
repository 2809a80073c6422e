#!/usr/bin/env bash
# s26 call n2 (issue 14): where n1's fixed cost goes. n1 (H100) fits K2V2 g32 at batch 8 as
# ~23 us + 2.43 us per 1K context (the streaming part at 85 % of copy bandwidth), so at 8 x 32K
# the fixed part is a fifth of the time. Per kernel (split, combine), without clock control:
# duration, warp instructions, SM active cycles (avg / min / max) at 8 x 4K / 32K / 128K for
# K2V2 g32 and fp16, at 8 x 32K with 1, 2 and 4 waves of splits (instructions per block from
# the differences), and 1 x 4K fp16. Then the decode benchmark at H_q 32 with SDPA and FlashInfer
# 0.6.18 beside it (the peers of issue 14, this build: the same kernels as n1, SASS only).
root=$(pwd)
o=$OUT
w=/tmp/n2
rm -rf $w && mkdir -p $w && tar xJf "$root/carry-n2/gpu.txz" -C $w
export LD_LIBRARY_PATH=$w/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PATH=$PATH:/usr/local/cuda/bin
cd $w
mkdir -p res
exec > >(tee -a "$w/res/run.txt") 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
m=gpu__time_duration.sum,smsp__inst_executed.sum,sm__cycles_active.avg,sm__cycles_active.min,sm__cycles_active.max,sm__cycles_elapsed.max,dram__bytes_read.sum,launch__grid_size
run() {  # name batch context target_blocks method
  timeout 60 ncu --clock-control none --metrics $m -k regex:"decode_(mma|combine)_kernel" \
    --launch-skip 6 --launch-count 2 ./cda --repeats 3 --no-maintenance --batch $2 --context $3 \
    --target-blocks $4 --only "$5" >res/ncu_$1.txt 2>&1
  echo "== $1 rc=$?"
  grep -E "decode_(mma|combine)_kernel|duration|inst_executed|cycles_active|cycles_elapsed|bytes_read|grid_size" res/ncu_$1.txt |
    sed 's/  */ /g; s/(int, int, int, int, bool, bool)//; s/void vq::cuda:://' | cut -c1-110
}
for c in 4096 32768 131072; do run k2_8x$c 8 $c 0 "skvq K2V2 g32"; done
for tb in 1056 2112; do run k2_8x32768_tb$tb 8 32768 $tb "skvq K2V2 g32"; done
for c in 4096 32768; do run f16_8x$c 8 $c 0 "fp16 full"; done
run f16_1x4096 1 4096 0 "fp16 full"
run k2_1x4096 1 4096 0 "skvq K2V2 g32"
echo "== timing (events, read flush) K2V2 g32 8 x 32K, target blocks 264 / 396 / 528 / 640 / 792"
for tb in 264 396 528 640 792; do
  r=$(timeout 40 ./cda --repeats 20 --no-maintenance --batch 8 --context 32768 --only "skvq K2V2 g32" \
    --target-blocks $tb 2>&1 | grep -E "^\| 8 \| 32768 \| skvq K2V2 g32 ")
  echo "tb $tb $r"
done
# FlashInfer 0.6.18's paged decode beside this build at H_q 32 (site.txz: the two wheels unzipped
# here without CUTLASS's python / examples / test and CCCL's python / docs / benchmarks folders)
rm -rf /tmp/vq-site && mkdir -p /tmp/vq-site && tar xJf "$root/carry-n2/site.txz" -C /tmp/vq-site
SECONDS=0; timeout 150 ./cda --repeats 20 --no-maintenance --hq 32 --csv res/bench_hq32.csv >res/decode_hq32.txt 2>&1
echo "== bench hq 32 rc=$? ${SECONDS}s"
SECONDS=0
(cd $root && PYTHONPATH=/tmp/vq-site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 \
  FLASHINFER_WORKSPACE_BASE=/tmp/vq-fi FLASHINFER_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 \
  timeout 300 python3 tools/bench_flashinfer.py $w/res/bench_hq32.csv --repeats 20 --hq 32 \
  >$w/res/flashinfer_hq32.txt 2>&1)
echo "== flashinfer hq 32 rc=$? ${SECONDS}s"
(cd $root && PYTHONUNBUFFERED=1 timeout 150 python3 tools/bench_sdpa.py $w/res/bench_hq32.csv \
  --repeats 20 --skip-prefill --hq 32 >$w/res/sdpa_hq32.txt 2>&1)
echo "== sdpa hq 32 rc=$?"
grep -E "^JIT|not importable|rror" res/flashinfer_hq32.txt | head -5
grep -E "^\| (1|8) \| (4096|32768|131072) \| (torch SDPA|FlashInfer|fp16 full|skvq K2V2 g32|skvq K4V4 g32) " res/flashinfer_hq32.txt | head -60
sed -n '/^## Peer targets/,$p' res/flashinfer_hq32.txt | head -20
tar czf $o/n2.tgz res
