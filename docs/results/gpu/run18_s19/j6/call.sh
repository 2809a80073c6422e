#!/usr/bin/env bash
# s19 call j6 (issue 19): the quiet-host CPU run of tools/llama_cpp/host_run.sh on the GPU host's
# CPU (Intel, 16 cores, AVX-512 BF16) with the bundle of `tools/llama_cpp/host_bundle.sh carry-j6
# build-v4` (main after merging helper 47's bf16 packed values), then the bf16 values against the
# fp32 ones in one binary (bench_decode_attention --isa avx512bf16 / avx512vnni, interleaved,
# twice) on that CPU. The host converts the shipped model to GGUF itself.
set -u
root=$(pwd)
python3 tools/llama_cpp/hf_to_gguf.py models/vq-mini-llama carry-j6/vq-mini-llama.bf16.gguf \
  --gguf-py carry-j6/gguf-py 2>&1 | tail -2
bash carry-j6/host_run.sh "$root/carry-j6" "$OUT" 230
export LD_LIBRARY_PATH=$root/carry-j6/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
for rep in 1 2; do
  for isa in avx512bf16 avx512vnni; do
    for shape in 2,64,3 8,128,4; do
      echo "## isa $isa shape $shape rep $rep" >>"$OUT/isa.txt"
      timeout 40 carry-j6/bench_decode_attention --contexts 32768 --shape $shape --repeats 10 \
        --threads 1,16 --isa $isa >>"$OUT/isa.txt" 2>&1
    done
  done
done
grep -E "isa|K4V4|K2V2" "$OUT/isa.txt" | head -60
tail -30 "$OUT/e2e.txt"
