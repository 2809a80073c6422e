#!/usr/bin/env bash
# Builds the GPU test and benchmark programs (VQ_CUDA=ON, portable x86-64 host code) and packs
# them, stripped, with the shared libraries a bare GPU host may lack (libxxhash, libgomp) into
# DIR/gpu.txz next to scripts/gpu_run.sh's copy, so a machine with only the CUDA driver, Python
# and PyTorch can run the whole GPU suite and the benchmarks; the Python benchmark scripts
# (tools/bench_sdpa.py, tools/bench_flashinfer.py, bench/cuda_prefill_sdpa.py) and the peers'
# wheels in .whl/ (if any) are copied beside it, so the bundle runs from any checkout.
#
#   scripts/gpu_bundle.sh [DIR (gpu-bundle)] [BUILD (build-cuda)]
#   then on the GPU host, from the checkout:  bash DIR/gpu_run.sh
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-gpu-bundle}
build=${2:-build-cuda}
export PATH=$PATH:/usr/local/cuda/bin
tests=(test_cuda_decode test_cuda_skvq test_cuda_snapkv test_cuda_caches
  test_cuda_prefill test_backend_ops_cuda test_cuda_engine)
benches=(cuda_decode_attention cuda_prefill_attention)
# VQ_BUNDLE=peers: the decode benchmark and the decode test plus the peers' wheels (.whl/:
# FlashInfer and its tvm-ffi), for a call that checks and times ours beside SDPA and FlashInfer;
# the full bundle and the checkout together already fill most of the 64 MiB a device call carries
# (the whole FlashInfer wheel, 18 MB: its JIT needs the CCCL and CUTLASS headers it bundles; with
# the decode test alone beside the benchmark the call carries ~59 MB)
# VQ_BUNDLE=engine: the CUDA engine's test alone (test_cuda_engine), no benchmarks: a small
# bundle for a call that checks the model forward on the GPU (it reads models/ and tests/data/
# of the checkout: gpu_run.sh sets VQ_SOURCE_DIR)
# VQ_BUNDLE=decode: the decode-attention programs alone (decode and cache tests, the op harness,
# the decode benchmark) plus the peers' wheels when .whl/ holds them: a call that checks the
# decode kernels and times them beside SDPA and FlashInfer (gpu_run.sh runs what it finds)
# VQ_BUNDLE=prefill: the prefill-attention programs alone (the prefill, cache and op-harness
# tests, the prefill benchmark): a call that checks the prefill kernels and times them beside
# SDPA (bench/cuda_prefill_sdpa.py)
peers=0
if [ "${VQ_BUNDLE:-full}" = prefill ]; then
  tests=(test_cuda_prefill test_cuda_caches test_backend_ops_cuda)
  benches=(cuda_prefill_attention)
fi
if [ "${VQ_BUNDLE:-full}" = decode ]; then
  tests=(test_cuda_decode test_cuda_caches test_backend_ops_cuda)
  benches=(cuda_decode_attention)
  ls .whl/*.whl >/dev/null 2>&1 && peers=1
fi
if [ "${VQ_BUNDLE:-full}" = engine ]; then
  tests=(test_cuda_engine)
  benches=()
fi
if [ "${VQ_BUNDLE:-full}" = peers ]; then
  peers=1
  tests=(test_cuda_decode)
  benches=(cuda_decode_attention)
fi
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DVQ_CUDA=ON -DVQ_NATIVE=OFF >/dev/null
cmake --build "$build" -j"$(nproc)" --target "${tests[@]+"${tests[@]}"}" "${benches[@]+"${benches[@]}"}"
stage=$(mktemp -d)
mkdir -p "$stage/lib" "$dir"
for t in "${tests[@]+"${tests[@]}"}"; do strip -o "$stage/$t" "$build/tests/$t"; done
for b in "${benches[@]+"${benches[@]}"}"; do strip -o "$stage/$b" "$build/bench/$b"; done
for lib in libxxhash.so.0 libgomp.so.1; do
  cp -L "$(ldconfig -p | awk -v l="$lib" '$1 == l { print $NF; exit }')" "$stage/lib/"
done
# one solid xz stream with a dictionary larger than a program: every program carries the same
# kernels, so the second and later copies cost almost nothing (8 programs: 13 MB instead of 80)
tar cf - -C "$stage" . | xz -T0 --lzma2=preset=6,dict=512MiB >"$dir/gpu.txz"
cp scripts/gpu_run.sh tools/gpu_timing.py tools/bench_sdpa.py tools/bench_flashinfer.py bench/cuda_prefill_sdpa.py "$dir/"
# the peers' wheels (FlashInfer and its tvm-ffi, fetched once into .whl/ with pip download; see
# tools/bench_flashinfer.py): gpu_run.sh installs them on the GPU host
if [ "$peers" = 1 ]; then
  ls .whl/*.whl >/dev/null 2>&1 || { echo "VQ_BUNDLE=peers needs the wheels in .whl/" >&2; exit 1; }
  mkdir -p "$dir/whl"
  cp .whl/*.whl "$dir/whl/"
fi
rm -rf "$stage"
echo "bundle: $dir/gpu.txz ($(du -h "$dir/gpu.txz" | cut -f1)); on the GPU host: bash $dir/gpu_run.sh"
