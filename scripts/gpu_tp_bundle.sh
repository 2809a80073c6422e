#!/usr/bin/env bash
# Packs the tensor-parallel CUDA checks for a device call (issue 18): test_cuda_tensor_parallel,
# test_nccl_communicator, test_cuda_engine (the one-rank path) and the veloxquant CLI, built with
# NCCL (-DVQ_NCCL=ON; libnccl.so.2 is not packed: gpu_tp_run.sh finds the host's), stripped, with
# libxxhash and libgomp, as one xz stream in DIR/gpu.txz beside scripts/gpu_tp_run.sh.
#
#   scripts/gpu_tp_bundle.sh [DIR (gpu-tp-bundle)] [BUILD (build-cuda)]
#   then on the GPU host, from a checkout:  bash DIR/gpu_tp_run.sh
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-gpu-tp-bundle}
build=${2:-build-cuda}
export PATH=$PATH:/usr/local/cuda/bin
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DVQ_CUDA=ON -DVQ_NATIVE=OFF -DVQ_NCCL=ON >/dev/null
tests="test_cuda_tensor_parallel test_nccl_communicator test_cuda_engine"
# shellcheck disable=SC2086
cmake --build "$build" -j"$(nproc)" --target veloxquant $tests
stage=$(mktemp -d)
mkdir -p "$stage/lib" "$dir"
strip -o "$stage/veloxquant" "$build/veloxquant"
for t in $tests; do strip -o "$stage/$t" "$build/tests/$t"; done
for lib in libxxhash.so.0 libgomp.so.1; do
  cp -L "$(ldconfig -p | awk -v l="$lib" '$1 == l { print $NF; exit }')" "$stage/lib/"
done
tar cf - -C "$stage" . | xz -T0 --lzma2=preset=6,dict=512MiB >"$dir/gpu.txz"
cp scripts/gpu_tp_run.sh "$dir/"
rm -rf "$stage"
echo "bundle: $dir/gpu.txz ($(du -h "$dir/gpu.txz" | cut -f1)); on the GPU host: bash $dir/gpu_tp_run.sh"
