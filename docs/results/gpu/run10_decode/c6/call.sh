#!/usr/bin/env bash
# s11 call 6: why fp16 rows decode 18% slower than in run 9: this session's decode benchmark
# (1be68f1, cur.txz = call 4's bundle) against the same tree built with
# -DVQ_EXP_PARAM_DIRECT (exp_bench: the tensor-core split kernel read the __grid_constant__
# kernel parameter, `__syncthreads(); const DecodeParams& p = P;`, instead of the block's copy in
# shared memory; right for non-batched launches only, an experiment build not in the tree),
# interleaved twice, fp16 rows and the packed views. The change that keeps both is branch
# s11-kparam (not run on a device).
here=$(cd "$(dirname "$0")" && pwd)
o=$OUT
rm -rf /tmp/c6 && mkdir -p /tmp/c6 && tar xJf "$here/cur.txz" -C /tmp/c6
xz -dc "$here/exp_bench.xz" >/tmp/c6/exp_bench && chmod +x /tmp/c6/exp_bench
export LD_LIBRARY_PATH=/tmp/c6/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
cd /tmp/c6
for pass in 1 2; do
  for b in cuda_decode_attention exp_bench; do
    for bc in "8 32768" "1 4096" "8 131072"; do
      set -- $bc
      for m in "fp16 full" "skvq K2V2 g32" "skvq K4V4 g32"; do
        r=$(timeout 60 ./$b --only "$m" --batch $1 --context $2 --repeats 20 --no-maintenance 2>&1 | grep -E "^\| $1 \| $2 " | head -1)
        echo "pass $pass $b: $r" | tee -a $o/run.txt
      done
    done
  done
done
