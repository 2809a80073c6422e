#!/usr/bin/env bash
# s19 call j7 (issue 19): j6's bf16-against-fp32 values comparison again, quieter: after 40 s of
# settling, bench_decode_attention --isa avx512bf16 / avx512vnni alternated four times, 1 thread,
# 32K, the shipped shape and 8 x 128 x 4 (the j6 bundle, carry-j6).
set -u
root=$(pwd)
export LD_LIBRARY_PATH=$root/carry-j6/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
sleep 40
uptime >"$OUT/isa.txt"
for rep in 1 2 3 4; do
  for isa in avx512bf16 avx512vnni; do
    for shape in 2,64,3 8,128,4; do
      echo "## isa $isa shape $shape rep $rep $(cut -d' ' -f1 /proc/loadavg)" >>"$OUT/isa.txt"
      timeout 40 carry-j6/bench_decode_attention --contexts 32768 --shape $shape --repeats 15 \
        --threads 1 --isa $isa 2>&1 | grep -E "K4V4|K2V2" >>"$OUT/isa.txt"
    done
  done
done
cat "$OUT/isa.txt"
