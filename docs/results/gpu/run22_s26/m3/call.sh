#!/usr/bin/env bash
# s26 call m3 (issues 16, 13): session 24's call m2, never run (no device in session 25), at
# main f7a9328 (built SASS-only here). m2 was: m1's build with ValueClipFloorMatchesCpu's second
# case made valid
# (window 48 for key runs of 32; m1 threw at its config check) and its snapkv+skvq case at
# 2-bit values; then the session-23 2.5-bit cache's passkey on the GPU, each mode in its own run
# (m1 ran full and the cache in both modes in one and hit its 300 s limit). Added here: fp16
# decode timed over split-block targets (8 x 32K, 8 x 128K), and an export of n1's ncu report.
root=$(pwd)
o=$OUT
w=/tmp/m3
rm -rf $w && mkdir -p $w && tar xJf "$root/carry-m3/gpu.txz" -C $w
export LD_LIBRARY_PATH=$w/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
for d in /usr/local/cuda/lib64 /opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib; do
  [ -e "$d/libcublas.so.13" ] && LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$d
done
export VQ_SOURCE_DIR=$root VQ_MODEL_DIR=$root/models/vq-mini-llama
mkdir -p $o/res
exec > >(tee -a "$o/res/run.txt") 2>&1
SECONDS=0
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 $w/test_cuda_caches >$o/res/test_cuda_caches.txt 2>&1
echo "test_cuda_caches rc=$? ${SECONDS}s"
grep -E "^\[(  FAILED|  PASSED)|worst" $o/res/test_cuda_caches.txt | head -30
# fp16 rows are bandwidth bound: n2's idle tail (11 % of the SMs' time at 8 x 32K) may cost them
# less with more waves of splits (the planner takes one wave, 264 blocks); event timing, read flush
for c in 32768 131072; do
  for tb in 0 528 1056 2112; do
    r=$(timeout 60 $w/cda --repeats 20 --no-maintenance --batch 8 --context $c --only "fp16 full" \
      --target-blocks $tb 2>&1 | grep -E "^\| 8 \| $c \| fp16 full ")
    echo "fp16 8 x $c tb $tb $r"
  done
done
cd $root
# n1's ncu report of the K2V2 g32 split kernel (8 x 32K, H_q 32): executed instructions and stall
# samples per SASS instruction, for a read here (where the per-block instructions go)
SECONDS=0
PATH=$PATH:/usr/local/cuda/bin ncu --import carry-m3/ncu_skvqK2V2g32.ncu-rep --page source --csv --print-source sass \
  >$o/res/k2v2_sass.csv 2>$o/res/k2v2_sass.err
echo "sass export rc=$? ${SECONDS}s $(wc -l <$o/res/k2v2_sass.csv) lines"
gzip -f $o/res/k2v2_sass.csv
cp carry-m3/qm.bin /tmp/qm.bin
B=skvq:bits_key=2:bits_value=2:key_axis=channel:rotation=hadamard:meta=fp8_e4m3:key_rows=64:n_sink=0:query_moments_file=/tmp/qm.bin
R=$B:rotate_values=true:value_clip_floor=0.5
P=:protect=0.01:protect_values=false:protect_scoring=external
for mode in agnostic aware; do
  SECONDS=0
  timeout 150 $w/veloxquant eval passkey --device cuda --prompts 216 --mode $mode --json --methods "$R$P" >$o/res/pk_gpu_$mode.json 2>$o/res/pk_gpu_$mode.err
  echo "passkey $mode rc=$? ${SECONDS}s"
  tr '\r' '\n' <$o/res/pk_gpu_$mode.err | tail -2
done
