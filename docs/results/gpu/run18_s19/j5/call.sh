#!/usr/bin/env bash
# s19 call j5 (issues 13, 14, 19): main after the session's merges (the any-bits decode instance;
# the CPU's bf16 packed values, which the GPU tests' CPU references and golden comparisons run
# beside): the engine, eval and cache tests on the device.
root=$(pwd)
o=$OUT
w=/tmp/j5
rm -rf $w && mkdir -p $w && tar xJf "$root/carry-j5/gpu.txz" -C $w
export LD_LIBRARY_PATH=$w/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
for d in /usr/local/cuda/lib64 /opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib; do
  [ -e "$d/libcublas.so.13" ] && LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$d
done
export VQ_SOURCE_DIR=$root PATH=$PATH:/usr/local/cuda/bin
cd $w
mkdir -p res
exec > >(tee -a "$w/res/run.txt") 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
lscpu | grep -o "avx512_bf16\|avx512_vbmi " | sort -u | tr '\n' ' '; echo
t() {  # label, limit, command...
  local label=$1 limit=$2; shift 2
  SECONDS=0; timeout "$limit" "$@" >res/log_$label.txt 2>&1; local rc=$?
  echo "== $label rc=$rc ${SECONDS}s"
  grep -E "^\[(  FAILED|  PASSED)|FAILED TEST|tests ran|worst|ppl|passkey" res/log_$label.txt | head -40
  [ $rc -eq 0 ] || grep -B3 -A25 "Failure\|rror" res/log_$label.txt | head -80
}
t engine 300 ./test_cuda_engine
t eval 400 ./test_cuda_eval
t caches 300 ./test_cuda_caches
tar czf $o/j5.tgz res
