#!/usr/bin/env bash
# s18 call i3 (issue 13): skvq_protect_scoring=external on the device (the eval refusal removed):
# CudaCaches.SkvqProtectExternalScoresMatchCpu and the cache tests around it, the eval tests
# (ExternalScoringTextFiguresMatchCpu now with skvq:protect=0.05:protect_scoring=external).
root=$(pwd)
o=$OUT
export PATH=$PATH:/usr/local/cuda/bin
w=/tmp/i3
rm -rf $w && mkdir -p $w && tar xJf "$root/carry-i3/gpu.txz" -C $w
export LD_LIBRARY_PATH=$w/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
for d in /usr/local/cuda/lib64 /opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib; do
  [ -e "$d/libcublas.so.13" ] && LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$d
done
export VQ_SOURCE_DIR=$root
cd $w
exec > >(tee -a "$o/run.txt") 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
t() {  # label, limit, command...
  local label=$1 limit=$2; shift 2
  SECONDS=0; timeout "$limit" "$@" >$w/log_$label.txt 2>&1; local rc=$?
  echo "== $label rc=$rc ${SECONDS}s"
  grep -E "^\[(  FAILED|  PASSED|  SKIPPED)|worst|FAILED TEST|tests ran|external|protect" $w/log_$label.txt | head -30
  [ $rc -eq 0 ] || grep -B3 -A25 "Failure\|rror" $w/log_$label.txt | head -80
}
t caches 300 ./test_cuda_caches
t eval 400 ./test_cuda_eval
