#!/usr/bin/env bash
# s19 call j2 (issue 14): resident blocks of the packed tensor-core decode kernels. The fixed
# group-32 instances (K2V2 / K4V4 g32, f16 metadata) built with __launch_bounds__ minimum blocks
# (G <= 4, G > 4) = (4, 3) (main), (5, 3), (6, 3) and (4, 4): 123 / 96 / 80 registers at G 4
# (spilling 0 / 36-44 / 100-112 bytes), 168 / 128 at G 16. The planner sizes its splits from the
# occupancy of the instance it runs. Each binary twice, interleaved, at H_q 32 and 128, L2 read
# flush (bench/cuda_decode_attention.cu).
root=$(pwd)
o=$OUT
w=/tmp/j2
rm -rf $w && mkdir -p $w && tar xJf "$root/carry-j2/gpu.txz" -C $w
export LD_LIBRARY_PATH=$w/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
cd $w
mkdir -p res
exec > >(tee -a "$w/res/run.txt") 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
for rep in 1 2; do
  for hq in 32 128; do
    for v in 4_3 5_3 6_3 4_4; do
      SECONDS=0; timeout 120 ./cda_$v --repeats 20 --no-maintenance --hq $hq \
        --csv res/bench_hq${hq}_${v}_$rep.csv >res/decode_hq${hq}_${v}_$rep.txt 2>&1
      echo "== $v hq $hq rep $rep rc=$? ${SECONDS}s"
    done
  done
done
tar czf $o/j2.tgz -C $w res
