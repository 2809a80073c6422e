#!/usr/bin/env bash
# s27 call m4 (issues 19, 14, 16): first the host's CPU, idle (issue 19: the decode worker pool's
# guided claims, bed802b, at 16 threads beside llama.cpp's f16 and q4_0 caches, same call; session
# 17 measured 0.73x llama.cpp f16 at 16 threads here), then two parts of session 26's m3 that never
# ran: test_cuda_caches on the device (ValueClipFloorMatchesCpu has never run there) and the
# 2.496-bit cache's passkey on the GPU, question-agnostic (the mode that misses by one prompt on
# the CPU). Carry: carry-m4/ = host/ (tools/llama_cpp/host_bundle.sh at bed802b: bench_e2e
# -march=x86-64-v4, static llama-bench, gguf-py), gpu.txz (m3's SASS-only test_cuda_caches and
# veloxquant, built at f7a9328 + 22ad791's flags; the pool change is CPU-only), qm.bin.
root=$(pwd)
o=$OUT
mkdir -p $o/res
exec > >(tee -a "$o/res/run.txt") 2>&1
h=$root/carry-m4/host
export LD_LIBRARY_PATH=$h/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
SECONDS=0
date -u; nproc; lscpu | grep -E "Model name|^CPU\(s\)"; uptime
python3 tools/llama_cpp/hf_to_gguf.py models/vq-mini-llama /tmp/vq.gguf --gguf-py $h/gguf-py >/dev/null 2>&1
echo "gguf rc=$? ${SECONDS}s"
all=$(nproc)
M="full;skvq:bits_key=4:bits_value=4;skvq:bits_key=2:bits_value=2"
for t in $all 8 2; do
  SECONDS=0
  timeout 70 $h/bench_e2e --prefill-step 2048 --contexts 2048,8192 --methods "$M" --threads $t \
    --repeats 2 --decode 48 --cpu-time >$o/res/e2e_t$t.txt 2>&1
  echo "e2e t$t rc=$? ${SECONDS}s"
  grep -E "^\| [28]|threads" $o/res/e2e_t$t.txt | cut -c1-150
  for ct in f16 q4_0; do
    timeout 40 $h/llama-bench -m /tmp/vq.gguf -t $t -r 2 -fa 1 -ctk $ct -ctv $ct -p 0 -n 32 \
      -d 2048,8192 -o md >$o/res/llama_${ct}_t$t.txt 2>&1
    echo "llama $ct t$t rc=$?"; grep "tg32" $o/res/llama_${ct}_t$t.txt
  done
done
# the GPU: unpack m3's binaries
w=/tmp/m4
rm -rf $w && mkdir -p $w && tar xJf "$root/carry-m4/gpu.txz" -C $w
export LD_LIBRARY_PATH=$w/lib:$LD_LIBRARY_PATH
for d in /usr/local/cuda/lib64 /opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib; do
  [ -e "$d/libcublas.so.13" ] && LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$d
done
export VQ_SOURCE_DIR=$root VQ_MODEL_DIR=$root/models/vq-mini-llama
nvidia-smi --query-gpu=name --format=csv,noheader
SECONDS=0
timeout 150 $w/test_cuda_caches >$o/res/test_cuda_caches.txt 2>&1
echo "test_cuda_caches rc=$? ${SECONDS}s"
grep -E "^\[(  FAILED|  PASSED)|worst|tests ran" $o/res/test_cuda_caches.txt | head -30
cp carry-m4/qm.bin /tmp/qm.bin
B=skvq:bits_key=2:bits_value=2:key_axis=channel:rotation=hadamard:meta=fp8_e4m3:key_rows=64:n_sink=0:query_moments_file=/tmp/qm.bin
R=$B:rotate_values=true:value_clip_floor=0.5
P=:protect=0.01:protect_values=false:protect_scoring=external
SECONDS=0
timeout 170 $w/veloxquant eval passkey --device cuda --prompts 216 --mode agnostic --json --methods "$R$P" \
  >$o/res/pk_gpu_agnostic.json 2>$o/res/pk_gpu_agnostic.err
echo "passkey agnostic rc=$? ${SECONDS}s"
tr '\r' '\n' <$o/res/pk_gpu_agnostic.err | tail -3
