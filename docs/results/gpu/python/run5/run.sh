#!/usr/bin/env bash
# Issue 15 on the H200, session 8: the package's CUDA tests and the batch-1 benchmark at 32K with
# the decode step in the model's dtype (cuda::decode_attention_typed). optimum-quanto JIT-builds
# its kernels at first use (about 100 s of compiling on the host's cores): that build runs first
# and alone, so the timed runs share the host with nothing. Every cache runs 3 times, interleaved
# (--rounds 3): the table is the median run with the rounds' range.
set -u
C=carry-lead
mkdir -p /tmp/site && tar xJf $C/site.txz -C /tmp/site
pip install -q --no-index --no-deps --target /tmp/site $C/optimum_quanto-*.whl >/dev/null 2>&1
export LD_LIBRARY_PATH=$PWD/$C/lib:${LD_LIBRARY_PATH:-} PYTHONPATH=/tmp/site
L=$OUT/log.txt
B=$C/bench_python_cache.py  # this branch's copy: a call sends the session's checkout
t0=$(date +%s); ts() { echo "[t+$(( $(date +%s) - t0 ))s] $*" >>$L; }
nvidia-smi --query-gpu=name,driver_version --format=csv >$OUT/env.txt 2>&1
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)" >>$OUT/env.txt 2>&1
ts "quanto warm"; timeout 200 python3 $B --batches 1 --context 256 --gen 2 --layers 1 --caches quanto2,quanto4 >$OUT/quanto_warm.log 2>&1; ts "rc=$?"
VQ="vq:full,vq:skvq:bits_key=4:bits_value=4,vq:skvq:bits_key=2:bits_value=2,vq:snapkv+skvq:keep=0.25:scoring=query:pool_kernel=15:keep_window=true:evict_at=prompt_end:bits_key=4:bits_value=4"
ts "b1 32K"; timeout 240 python3 $B --batches 1 --context 32768 --gen 32 --rounds 3 --caches "$VQ,dynamic,quanto4,quanto2" --json $OUT/b1.json >$OUT/b1.log 2>&1; ts "rc=$?"
ts "b1 floor"; timeout 60 python3 $B --batches 1 --context 256 --gen 32 --rounds 3 --caches "dynamic,vq:full,vq:skvq:bits_key=2:bits_value=2" --json $OUT/floor.json >$OUT/floor.log 2>&1; ts "rc=$?"

ts "pytest"; (cd $C/pytests && timeout 120 python3 -m pytest -q -rA test_cuda.py) >$OUT/test_cuda.log 2>&1; ts "rc=$?"
