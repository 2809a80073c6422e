#!/usr/bin/env bash
# Issue 15 on the H200, session 9: compiled decode steps (python/veloxquant/compiled.py).
# 1. the package's CUDA tests (test_cuda.py with the new compiled-step test, test_compile.py) while
#    optimum-quanto JIT-builds its kernels (CPU work; nothing is timed yet);
# 2. batch 1 at 32K, every cache twice, interleaved (--rounds 2): veloxquant compiled (vqc:, CUDA
#    graphs between our ops) and eager (vq:), transformers' StaticCache compiled (the fastest
#    transformers decode), DynamicCache and QuantizedCache (quanto 2 and 4 bits), eager.
set -u
C=carry-lead
mkdir -p /tmp/site && tar xJf $C/site.txz -C /tmp/site
pip install -q --no-index --no-deps --target /tmp/site $C/optimum_quanto-*.whl >/dev/null 2>&1
export LD_LIBRARY_PATH=$PWD/$C/lib:${LD_LIBRARY_PATH:-} PYTHONPATH=/tmp/site
L=$OUT/log.txt
B=$C/bench_python_cache.py
t0=$(date +%s); ts() { echo "[t+$(( $(date +%s) - t0 ))s] $*" >>$L; }
nvidia-smi --query-gpu=name,driver_version --format=csv >$OUT/env.txt 2>&1
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)" >>$OUT/env.txt 2>&1
ts "quanto warm + kdec tests + pytest"
timeout 200 python3 $B --batches 1 --context 256 --gen 2 --layers 1 --caches quanto2,quanto4 >$OUT/quanto_warm.log 2>&1 &
(bash $C/kdec_tests.sh); ts "kdec tests done"
(cd $C/pytests && timeout 200 python3 -m pytest -q -rA test_cuda.py test_compile.py) >$OUT/test_cuda.log 2>&1
ts "pytest rc=$?"
wait; ts "quanto warm done"
VQ="vqc:skvq:bits_key=2:bits_value=2,vqc:skvq:bits_key=4:bits_value=4,vq:skvq:bits_key=2:bits_value=2"
ts "b1 32K"
timeout 290 python3 $B --batches 1 --context 32768 --gen 32 --rounds 2 \
  --caches "$VQ,static,dynamic,quanto2,quanto4" --json $OUT/b1.json >$OUT/b1.log 2>&1
ts "rc=$?"
