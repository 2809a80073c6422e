#!/usr/bin/env bash
# s18 call i8 (review): the batched decode tests' cache methods from one helper (test only).
root=$(pwd)
o=$OUT
w=/tmp/i8
rm -rf $w && mkdir -p $w && tar xJf "$root/carry-i8/gpu.txz" -C $w
export LD_LIBRARY_PATH=$w/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
cd $w
exec > >(tee -a "$o/run.txt") 2>&1
SECONDS=0; timeout 120 ./test_cuda_decode_batch >$w/log.txt 2>&1; rc=$?
echo "== test_cuda_decode_batch rc=$rc ${SECONDS}s"
grep -E "^\[(  FAILED|  PASSED|       OK)|FAILED TEST|Failure" $w/log.txt | head -20
