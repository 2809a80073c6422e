#!/usr/bin/env bash
# s27 call m5: m4 found CudaCaches.ValueClipFloorMatchesCpu failing on the H100 (its output file
# did not come back: too many files); rerun it alone with its output, then our full-cache decode
# at 16 / 15 / 12 / 8 threads on the host CPU (m4: 16 threads slower than 8). One output file.
root=$(pwd)
o=$OUT/m5.txt
exec >"$o" 2>&1
w=/tmp/m5
rm -rf $w && mkdir -p $w && tar xJf "$root/carry-m4/gpu.txz" -C $w
h=$root/carry-m4/host
export LD_LIBRARY_PATH=$w/lib:$h/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
for d in /usr/local/cuda/lib64 /opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib; do
  [ -e "$d/libcublas.so.13" ] && LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$d
done
export VQ_SOURCE_DIR=$root VQ_MODEL_DIR=$root/models/vq-mini-llama
timeout 60 $w/test_cuda_caches --gtest_filter='CudaCaches.ValueClipFloor*' 2>&1 | tail -60
uptime
for t in 16 15 12 8; do
  timeout 25 $h/bench_e2e --prefill-step 2048 --contexts 2048 --methods full --threads $t \
    --repeats 3 --decode 48 --no-bandwidth 2>&1 | grep -E "^\| 2048" | sed "s/^/t$t /"
done
ps -eo pcpu,comm --sort=-pcpu | head -8
