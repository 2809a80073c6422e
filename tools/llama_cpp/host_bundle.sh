#!/usr/bin/env bash
# Packs what tools/llama_cpp/host_run.sh needs on another x86-64 host with AVX-512 (the GPU
# host's CPU): bench_e2e and bench_decode_attention built with VQ_NATIVE=OFF and
# -march=x86-64-v4 (no -march=native; the packed decode kernels pick VNNI at run time), the
# shared libraries a bare host may lack (libxxhash, libgomp), a static llama-bench built with
# GGML_NATIVE=OFF and AVX-512 (tools/llama_cpp/compare.sh's llama.cpp source in
# .cache/llama_cpp), and llama.cpp's gguf-py: the host converts the shipped model itself (the
# 25 MB GGUF would not fit a device call's 64 MiB beside the checkout), from the checkout's root:
#   python3 tools/llama_cpp/hf_to_gguf.py models/vq-mini-llama DIR/vq-mini-llama.bf16.gguf \
#     --gguf-py DIR/gguf-py
#   tools/llama_cpp/host_bundle.sh DIR [BUILD (build-v4)]
set -euo pipefail
cd "$(dirname "$0")/../.."
dir=$1
build=${2:-build-v4}
work=.cache/llama_cpp
src=$work/llama_cpp_python-0.3.36/vendor/llama.cpp
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DVQ_NATIVE=OFF -DVQ_BUILD_TESTS=OFF \
  -DCMAKE_CXX_FLAGS="-march=x86-64-v4 -mtune=generic" >/dev/null
cmake --build "$build" -j"$(nproc)" --target bench_e2e bench_decode_attention
lb=$work/build-avx512
if [ ! -x "$lb/bin/llama-bench" ]; then
  cmake -S "$src" -B "$lb" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_OPENSSL=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
    -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX512_VBMI=ON >/dev/null
  cmake --build "$lb" -j"$(nproc)" --target llama-bench
fi
mkdir -p "$dir/lib"
strip -o "$dir/bench_e2e" "$build/bench/bench_e2e"
strip -o "$dir/bench_decode_attention" "$build/bench/bench_decode_attention"
strip -o "$dir/llama-bench" "$lb/bin/llama-bench"
for lib in libxxhash.so.0 libgomp.so.1; do
  cp -L "$(ldconfig -p | awk -v l="$lib" '$1 == l { print $NF; exit }')" "$dir/lib/"
done
cp -r "$src/gguf-py" tools/llama_cpp/host_run.sh "$dir/"
rm -rf "$dir/gguf-py/tests"
du -sh "$dir"
