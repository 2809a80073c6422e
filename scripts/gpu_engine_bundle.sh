#!/usr/bin/env bash
# Packs the CUDA engine's programs for a device call (issue 13): the veloxquant CLI (bench, eval
# --device cuda) and the engine's GPU tests (test_cuda_engine, test_cuda_eval), stripped, with
# libxxhash and libgomp, as one solid xz stream in DIR/gpu.txz beside scripts/gpu_engine_run.sh.
#
#   scripts/gpu_engine_bundle.sh [DIR (gpu-bundle)] [BUILD (build-cuda)]
#   then on the GPU host, from the checkout:  bash DIR/gpu_engine_run.sh tests|bench
# Other bundles set VQ_BUNDLE_TESTS (the test programs), VQ_BUNDLE_CMAKE (more configure
# options) and VQ_BUNDLE_RUN (the run script packed beside it): scripts/gpu_tp_bundle.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-gpu-bundle}
build=${2:-build-cuda}
tests=${VQ_BUNDLE_TESTS:-test_cuda_engine test_cuda_eval}
runner=${VQ_BUNDLE_RUN:-scripts/gpu_engine_run.sh}
export PATH=$PATH:/usr/local/cuda/bin
# shellcheck disable=SC2086
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DVQ_CUDA=ON -DVQ_NATIVE=OFF ${VQ_BUNDLE_CMAKE:-} >/dev/null
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
cp "$runner" "$dir/"
rm -rf "$stage"
echo "bundle: $dir/gpu.txz ($(du -h "$dir/gpu.txz" | cut -f1)); on the GPU host: bash $dir/$(basename "$runner")"
