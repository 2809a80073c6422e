#!/usr/bin/env bash
# s30 call p1 (issue 19): the GPU host's CPU (AVX-512). (1) session 29's AVX-512 code motion in
# src/ops/fused_attention.cpp run for the first time: the x86-64-v4 builds of the CPU attention,
# op-harness, forward and golden tests from main 1950d2a; (2) A/B of a weight-row prefetch in the
# AVX-512 dot products (kernels.cpp dot_rows / dot_rows_bf16, 4 rows ahead, as the AVX2 ones since
# 8979b93): base2 = 1950d2a, pf2 = the same with the prefetch, alternated; (3) decode attention
# at 32K (bench_decode_attention --flush) for the 70 % read-bandwidth target.
c=build-v4/carry
export LD_LIBRARY_PATH=$PWD/$c/lib VQ_SOURCE_DIR=$PWD OMP_WAIT_POLICY=passive
o=$OUT
lscpu | grep -E "Model name|^CPU\(s\)|Flags" | cut -c1-2000 > $o/host.txt
uptime >> $o/host.txt
for t in test_fused_attention test_backend_ops test_forward test_golden; do
  timeout 240 $c/$t > $o/$t.txt 2>&1; echo "$t rc=$?" | tee -a $o/tests_rc.txt
  tail -3 $o/$t.txt
done
m="full;skvq:bits_key=4:bits_value=4;skvq:bits_key=2:bits_value=2"
for round in 1 2; do
  for T in 1 2 16; do
    for b in base2 pf2; do
      echo "## ctx 2048 threads $T round $round: $b" >> $o/e2e_ab.txt
      timeout 120 $c/bench_e2e_$b --threads $T --repeats 2 --decode 48 --contexts 2048 \
        --prefill-step 2048 --no-bandwidth --methods "$m" 2>&1 | grep '^|' >> $o/e2e_ab.txt
    done
  done
done
for T in 1 16; do
  timeout 120 $c/bench_decode_attention --contexts 32768 --repeats 10 --threads $T --flush \
    >> $o/decode_attention.txt 2>&1
done
uptime >> $o/host.txt
