#!/usr/bin/env bash
# Issue 15 on the H200, call 2: the Python benchmark at 32K, batch 1 and 8. optimum-quanto JIT-builds
# its CUDA kernels at first use (minutes): a one-layer quanto run warms that build in the
# background while the veloxquant and DynamicCache rows run; the quanto rows come last.
set -u
C=build-pycarry
mkdir -p /tmp/site && tar xJf $C/site.txz -C /tmp/site
pip install -q --no-index --no-deps --target /tmp/site $C/optimum_quanto-*.whl >/dev/null 2>&1
export LD_LIBRARY_PATH=$PWD/$C/lib:${LD_LIBRARY_PATH:-} PYTHONPATH=/tmp/site
L=$OUT/log.txt
B=tools/bench_python_cache.py
t0=$(date +%s); ts() { echo "[t+$(( $(date +%s) - t0 ))s] $*" >>$L; }
(timeout 330 python3 $B --batches 1 --context 256 --gen 2 --layers 1 --caches quanto2,quanto4 >$OUT/quanto_warm.log 2>&1; echo "warm rc=$? at t+$(( $(date +%s) - t0 ))s" >>$OUT/quanto_warm.log) &
VQ="vq:full,vq:skvq:bits_key=4:bits_value=4,vq:skvq:bits_key=2:bits_value=2,vq:snapkv+skvq:keep=0.25:scoring=query:pool_kernel=15:keep_window=true:evict_at=prompt_end:bits_key=4:bits_value=4,dynamic"
ts "b1 vq+dynamic"; timeout 120 python3 $B --batches 1 --context 32768 --gen 16 --caches "$VQ" --json $OUT/b1.json >>$L 2>&1; ts "rc=$?"
ts "b8 vq+dynamic"; timeout 220 python3 $B --batches 8 --context 32768 --gen 16 --caches "$VQ" --json $OUT/b8.json >>$L 2>&1; ts "rc=$?"
wait
ts "b1 quanto"; timeout 45 python3 $B --batches 1 --context 32768 --gen 16 --caches quanto4,quanto2,dynamic --json $OUT/b1q.json >>$L 2>&1; ts "rc=$?"
ts "b8 quanto"; timeout 90 python3 $B --batches 8 --context 32768 --gen 16 --caches quanto4,quanto2 --json $OUT/b8q.json >>$L 2>&1; ts "rc=$?"
