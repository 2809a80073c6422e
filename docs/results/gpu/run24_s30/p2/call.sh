#!/usr/bin/env bash
# s30 call p2 (issue 19), the GPU host's CPU (AVX-512, x86-64-v4 builds): (1) the CPU attention
# tests after b453be8 (WindowEqualsSlicedRows: bits equal from a tile boundary, the fused bound
# from inside a tile), at 16 and 2 threads; (2) the AVX-512 weight-row prefetch again, now at 1,
# 2, 8 and 16 threads: base3 = main, pf3 = 4 rows ahead within the thread's rows only, pf4 = 4
# rows ahead always (p1's pf2), alternated three times.
c=build-v4/carry
export LD_LIBRARY_PATH=$PWD/$c/lib VQ_SOURCE_DIR=$PWD OMP_WAIT_POLICY=passive
o=$OUT
uptime >> $o/tests_rc.txt
timeout 120 $c/test_fused_attention > $o/test_fused_attention_t16.txt 2>&1; echo "t16 rc=$?" | tee -a $o/tests_rc.txt
OMP_NUM_THREADS=2 timeout 120 $c/test_fused_attention > $o/test_fused_attention_t2.txt 2>&1; echo "t2 rc=$?" | tee -a $o/tests_rc.txt
grep -E "FAILED|PASSED" $o/test_fused_attention_t*.txt
m="full;skvq:bits_key=4:bits_value=4;skvq:bits_key=2:bits_value=2"
for round in 1 2 3; do
  for T in 1 2 8 16; do
    for b in base3 pf3 pf4; do
      echo "## ctx 2048 threads $T round $round: $b" >> $o/e2e_ab.txt
      timeout 60 $c/bench_e2e_$b --threads $T --repeats 2 --decode 48 --contexts 2048 \
        --prefill-step 2048 --no-bandwidth --methods "$m" 2>&1 | grep '^| 2048' >> $o/e2e_ab.txt
    done
  done
done
uptime >> $o/tests_rc.txt
