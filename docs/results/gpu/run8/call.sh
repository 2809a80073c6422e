#!/usr/bin/env bash
# kdec device call: the decode bundle's gpu_run.sh (tests, decode bench, SDPA, FlashInfer when
# its wheels travel), then a few planner-knob rows, ncu + SASS of the packed kernels, and a short
# sanitizer pass over the decode cases. Results: $OUT/run.txt and $OUT/results.tgz.
here=$(cd "$(dirname "$0")" && pwd)
o=/tmp/kdec-out; rm -rf $o; mkdir -p $o
export PATH=$PATH:/usr/local/cuda/bin
OUT=$o VQ_SANITIZE=skip bash "$here/bundle/gpu_run.sh" 2>&1 | tee $o/run.txt
export LD_LIBRARY_PATH=/tmp/vq-gpu/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
cd /tmp/vq-gpu
if [ "${KNOBS:-1}" = 1 ]; then
  for m in "skvq K2V2 g32" "skvq K4V4 g32"; do
    for k in "--packed-stage-bytes 6144" "--target-blocks 1056"; do
      r=$(timeout 40 ./cuda_decode_attention --only "$m" --batch 8 --context 32768 --repeats 10 \
        --no-maintenance $k 2>&1 | grep -E "^\| 8 \| 32768")
      echo "knob $k: $r" | tee -a $o/run.txt
    done
  done
fi
bash "$here/prof.sh" $o 2>&1 | tee -a $o/run.txt
export VQ_HARNESS=small
for tool in memcheck racecheck; do
  timeout 60 compute-sanitizer --tool $tool --error-exitcode 86 --print-limit 20 ./test_backend_ops_cuda \
    --gtest_filter=BackendOpsCuda.DecodeAttention >$o/san_$tool.txt 2>&1
  echo "sanitizer $tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $o/san_$tool.txt | tail -1)" | tee -a $o/run.txt
done
cd $o && tar czf "$OUT/results.tgz" . && cp run.txt "$OUT/run.txt"
