#!/usr/bin/env bash
# s16 call g8 (issue 14): after the review refactor (the block's query rows in prefill_tc.cuh's
# PrefillRows, shared by both prefill kernels): the op harness's prefill cases through both
# kernels and the prefill test.
root=$(pwd)
o=$OUT
w=/tmp/g8
rm -rf $w && mkdir -p $w && tar xJf "$root/carry-g8/g8.txz" -C $w
export LD_LIBRARY_PATH=$w/wg/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
cd $w/wg
exec > >(tee -a "$o/run.txt") 2>&1
SECONDS=0; timeout 120 ./test_backend_ops_cuda --gtest_filter='BackendOpsCuda.PrefillAttention' >$w/h.txt 2>&1
echo "== harness rc=$? ${SECONDS}s"; grep -E "cases|PASSED|FAILED" $w/h.txt | head; grep -c ": OK" $w/h.txt
SECONDS=0; timeout 60 ./test_cuda_prefill >$w/p.txt 2>&1; echo "== prefill rc=$? ${SECONDS}s"; grep -E "PASSED|FAILED" $w/p.txt
