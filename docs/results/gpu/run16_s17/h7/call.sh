#!/usr/bin/env bash
# s17 call h7 (issue 19): the quiet-host CPU run of tools/llama_cpp/host_run.sh on the GPU host's
# CPU (16 cores, idle) with the bundle of `tools/llama_cpp/host_bundle.sh carry-h7 build-v4`
# (main at 774e4d6: bench_e2e and bench_decode_attention at -march=x86-64-v4, packed kernels
# chosen at run time; llama-bench of llama-cpp-python 0.3.36's llama.cpp, AVX-512, static). The
# host converts the shipped model to GGUF itself. Every table lands in OUT as it is printed.
set -u
root=$(pwd)
python3 tools/llama_cpp/hf_to_gguf.py models/vq-mini-llama carry-h7/vq-mini-llama.bf16.gguf \
  --gguf-py carry-h7/gguf-py 2>&1 | tail -2
bash carry-h7/host_run.sh "$root/carry-h7" "$OUT" 270
tail -40 "$OUT/e2e.txt"
