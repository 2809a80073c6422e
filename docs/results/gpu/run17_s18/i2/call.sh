#!/usr/bin/env bash
# s18 call i2 (issue 14), main at d343640's build (carry-i1): where batch-1 4K decode time goes
# (ncu: each kernel's duration, fp16 and K2V2 g32 at 1 x 4K, H_q 32), and a sweep of the
# planner's knobs (--packed-stage-bytes, --target-blocks) for the packed kernels at 8 x 32K and
# 8 x 128K (H_q 32): does a plan other than the default reach more of the copy bandwidth?
root=$(pwd)
o=$OUT
export PATH=$PATH:/usr/local/cuda/bin
w=/tmp/i2
rm -rf $w && mkdir -p $w && tar xJf "$root/carry-i1/gpu.txz" -C $w
export LD_LIBRARY_PATH=$w/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
cd $w
exec > >(tee -a "$o/run.txt") 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
for m in "fp16 full" "skvq K2V2 g32"; do
  SECONDS=0
  timeout 120 "$ncu" --metrics gpu__time_duration.sum,launch__grid_size,launch__block_size \
    -k regex:"decode" ./cuda_decode_attention --only "$m" --batch 1 --context 4096 --repeats 3 \
    --no-maintenance >$w/ncu.txt 2>&1
  echo "== ncu $m rc=$? ${SECONDS}s"
  grep -E "decode_(mma|combine|split)|gpu__time_duration|launch__grid_size" $w/ncu.txt | tail -12
  ./cuda_decode_attention --only "$m" --batch 1 --context 4096 --repeats 30 --no-maintenance | grep -E "^\| 1 \| 4096"
done
echo "== sweep: method, context, packed_stage_bytes, target_blocks -> row"
for m in "skvq K4V4 g32" "skvq K2V2 g32"; do
  for ctx in 32768 131072; do
    for psb in 0 10240 20480 30720 40960; do
      for tb in 0 264 396 660 792 1056; do
        r=$(timeout 30 ./cuda_decode_attention --only "$m" --batch 8 --context $ctx --repeats 20 \
          --no-maintenance --packed-stage-bytes $psb --target-blocks $tb 2>&1 | grep -E "^\| 8 \| $ctx" | head -1)
        echo "$m | $ctx | psb $psb | tb $tb | $r"
      done
    done
  done
done
