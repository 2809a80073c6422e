#!/usr/bin/env bash
# s27 call m6: test_cuda_caches at 8d4ec72 + the ValueClipFloorMatchesCpu fix (its snapkv+skvq
# case packs rows only at the prompt's end: m5 found no packed row to compare), whole binary; then
# the host CPU at 16 threads (three rounds), 12 and 8, ours (full, skvq K4V4) and llama.cpp f16 alternated, 2K
# context (m4 / m5 gave 755 / 1363 tok/s for our full cache: one run each is not enough here).
root=$(pwd)
o=$OUT/m6.txt
exec >"$o" 2>&1
w=/tmp/m6
rm -rf $w && mkdir -p $w && tar xJf "$root/carry-m6/t.txz" -C $w
h=$root/carry-m6/host
export LD_LIBRARY_PATH=$w/lib:$h/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
for d in /usr/local/cuda/lib64 /opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib; do
  [ -e "$d/libcublas.so.13" ] && LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$d
done
export VQ_SOURCE_DIR=$root VQ_MODEL_DIR=$root/models/vq-mini-llama
nvidia-smi --query-gpu=name --format=csv,noheader
SECONDS=0
timeout 120 $w/test_cuda_caches 2>&1 | grep -E "^\[(  FAILED|  PASSED| RUN  |       OK)|worst|Failure|tests ran" | head -80
echo "test_cuda_caches ${SECONDS}s"
python3 tools/llama_cpp/hf_to_gguf.py models/vq-mini-llama /tmp/vq.gguf --gguf-py $h/gguf-py >/dev/null 2>&1
uptime
for t in 16 16 16 12 8; do
  timeout 30 $h/bench_e2e --prefill-step 2048 --contexts 2048 --methods "full;skvq:bits_key=4:bits_value=4" \
    --threads $t --repeats 3 --decode 48 --no-bandwidth 2>&1 | grep -E "^\| 2048" | sed "s/^/ours t$t /"
  timeout 30 $h/llama-bench -m /tmp/vq.gguf -t $t -r 3 -fa 1 -ctk f16 -ctv f16 -p 0 -n 32 -d 2048 -o md \
    2>&1 | grep tg32 | sed "s/^/llama t$t /"
done
uptime
# decode attention alone at 8 x 128 x 4 (issue 19's 70 % target) on 1 and 16 threads, read flush
timeout 60 $h/bench_decode_attention --contexts 32768 --shape 8,128,4 --repeats 10 --threads 1,16 \
  --flush 2>&1 | grep -E "^\| (threads|1|16) "
