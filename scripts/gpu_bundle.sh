#!/usr/bin/env bash
# Builds the GPU test and benchmark programs (VQ_CUDA=ON, portable x86-64 host code) and packs
# them, stripped, with the shared libraries a bare GPU host may lack (libxxhash, libgomp) into
# DIR/gpu.txz next to scripts/gpu_run.sh's copy, so a machine with only the CUDA driver, Python
# and PyTorch can run the whole GPU suite and the benchmarks (it needs the repository's
# tools/bench_sdpa.py and bench/cuda_prefill_sdpa.py too: run it from a checkout).
#
#   scripts/gpu_bundle.sh [DIR (gpu-bundle)] [BUILD (build-cuda)]
#   then on the GPU host, from the checkout:  bash DIR/gpu_run.sh
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-gpu-bundle}
build=${2:-build-cuda}
export PATH=$PATH:/usr/local/cuda/bin
tests=(test_cuda_decode test_cuda_decode_formats test_cuda_skvq test_cuda_snapkv test_cuda_caches
  test_cuda_prefill test_backend_ops_cuda)
benches=(cuda_decode_attention cuda_prefill_attention)
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DVQ_CUDA=ON -DVQ_NATIVE=OFF >/dev/null
cmake --build "$build" -j"$(nproc)" --target "${tests[@]}" "${benches[@]}"
stage=$(mktemp -d)
mkdir -p "$stage/lib" "$dir"
for t in "${tests[@]}"; do strip -o "$stage/$t" "$build/tests/$t"; done
for b in "${benches[@]}"; do strip -o "$stage/$b" "$build/bench/$b"; done
for lib in libxxhash.so.0 libgomp.so.1; do
  cp -L "$(ldconfig -p | awk -v l="$lib" '$1 == l { print $NF; exit }')" "$stage/lib/"
done
tar cJf "$dir/gpu.txz" -C "$stage" .
cp scripts/gpu_run.sh "$dir/"
rm -rf "$stage"
echo "bundle: $dir/gpu.txz ($(du -h "$dir/gpu.txz" | cut -f1)); on the GPU host: bash $dir/gpu_run.sh"
