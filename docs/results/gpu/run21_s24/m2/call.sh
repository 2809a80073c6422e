#!/usr/bin/env bash
# s24 call m2 (issue 16): m1's build with ValueClipFloorMatchesCpu's second case made valid
# (window 48 for key runs of 32; m1 threw at its config check) and its snapkv+skvq case at
# 2-bit values; then the session-23 2.5-bit cache's passkey on the GPU, each mode in its own run
# (m1 ran full and the cache in both modes in one and hit its 300 s limit).
root=$(pwd)
o=$OUT
w=/tmp/m2
rm -rf $w && mkdir -p $w && tar xJf "$root/carry-m2/gpu.txz" -C $w
export LD_LIBRARY_PATH=$w/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
for d in /usr/local/cuda/lib64 /opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib; do
  [ -e "$d/libcublas.so.13" ] && LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$d
done
export VQ_SOURCE_DIR=$root VQ_MODEL_DIR=$root/models/vq-mini-llama
mkdir -p $o/res
exec > >(tee -a "$o/res/run.txt") 2>&1
SECONDS=0
timeout 90 $w/test_cuda_caches >$o/res/test_cuda_caches.txt 2>&1
echo "test_cuda_caches rc=$? ${SECONDS}s"
grep -E "^\[(  FAILED|  PASSED)|worst" $o/res/test_cuda_caches.txt | head -30
cd $root
cp carry-m2/qm.bin /tmp/qm.bin
B=skvq:bits_key=2:bits_value=2:key_axis=channel:rotation=hadamard:meta=fp8_e4m3:key_rows=64:n_sink=0:query_moments_file=/tmp/qm.bin
R=$B:rotate_values=true:value_clip_floor=0.5
P=:protect=0.01:protect_values=false:protect_scoring=external
for mode in agnostic aware; do
  SECONDS=0
  timeout 240 $w/veloxquant eval passkey --device cuda --prompts 216 --mode $mode --json --methods "$R$P" >$o/res/pk_gpu_$mode.json 2>$o/res/pk_gpu_$mode.err
  echo "passkey $mode rc=$? ${SECONDS}s"
  tr '\r' '\n' <$o/res/pk_gpu_$mode.err | tail -2
done
