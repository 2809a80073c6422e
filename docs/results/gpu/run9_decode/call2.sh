#!/usr/bin/env bash
# kdec call 2 (run 9): ours beside SDPA and FlashInfer in one call (VQ_BUNDLE=peers bundle in
# c2/: the decode benchmark alone, with the FlashInfer 0.6.18 and tvm-ffi wheels; the tests ran in
# call 1): the decode benchmark at
# H_q 32 (GQA 4) and 128 (GQA 16), SDPA bf16 at both, FlashInfer bf16 / fp8 (CUDA-core and tensor-core decode) at both,
# JIT built once before timing in one cache folder.
here=$(cd "$(dirname "$0")" && pwd)
o=$OUT
export PATH=$PATH:/usr/local/cuda/bin
rm -rf /tmp/vq-gpu && mkdir -p /tmp/vq-gpu && tar xJf "$here/c2/gpu.txz" -C /tmp/vq-gpu
export LD_LIBRARY_PATH=/tmp/vq-gpu/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
cd /tmp/vq-gpu
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader | tee $o/run.txt
SECONDS=0; timeout 60 ./cuda_decode_attention --csv $o/bench32.csv --repeats 20 --no-maintenance >$o/decode32.txt 2>&1
echo "bench hq32 rc=$? ${SECONDS}s" | tee -a $o/run.txt
SECONDS=0; timeout 50 ./cuda_decode_attention --hq 128 --csv $o/bench128.csv --repeats 20 --no-maintenance >$o/decode128.txt 2>&1
echo "bench hq128 rc=$? ${SECONDS}s" | tee -a $o/run.txt
cp $here/c2/*.py /tmp/vq-gpu/
SECONDS=0
PYTHONUNBUFFERED=1 timeout 50 python3 bench_sdpa.py $o/bench32.csv --repeats 20 --skip-prefill >$o/sdpa32.txt 2>&1
echo "sdpa32 rc=$? ${SECONDS}s" | tee -a $o/run.txt
PYTHONUNBUFFERED=1 timeout 40 python3 bench_sdpa.py $o/bench128.csv --repeats 20 --skip-prefill --hq 128 >$o/sdpa128.txt 2>&1
echo "sdpa128 rc=$? ${SECONDS}s" | tee -a $o/run.txt
SECONDS=0
# the two wheels (flashinfer-python 0.6.18, apache-tvm-ffi 0.1.15.post2) unpacked as they install:
# xz of their files is half their zip size, and the call's tree must stay under 64 MiB
mkdir -p /tmp/vq-site && tar xJf $here/c2/fi-site.txz -C /tmp/vq-site >$o/fi_install.txt 2>&1
echo "pip rc=$? ${SECONDS}s" | tee -a $o/run.txt
export PYTHONPATH=/tmp/vq-site FLASHINFER_WORKSPACE_BASE=/tmp/vq-fi FLASHINFER_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 PYTHONUNBUFFERED=1
sh="1x4096,8x32768,8x131072"
SECONDS=0; timeout 170 python3 bench_flashinfer.py $o/bench32.csv --repeats 20 --shapes $sh >$o/fi32.txt 2>&1
echo "flashinfer32 rc=$? ${SECONDS}s" | tee -a $o/run.txt
SECONDS=0; timeout 70 python3 bench_flashinfer.py $o/bench128.csv --repeats 20 --shapes $sh --hq 128 >$o/fi128.txt 2>&1
echo "flashinfer128 rc=$? ${SECONDS}s" | tee -a $o/run.txt
grep -hE "^JIT|not importable|Error" $o/fi32.txt $o/fi128.txt | head | tee -a $o/run.txt
cd $o && tar czf logs.tgz *.txt *.csv && cat decode32.txt sdpa32.txt fi32.txt decode128.txt sdpa128.txt fi128.txt >tables.txt
rm -f fi_install.txt decode32.txt decode128.txt sdpa32.txt sdpa128.txt fi32.txt fi128.txt
ls $o
