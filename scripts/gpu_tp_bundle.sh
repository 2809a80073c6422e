#!/usr/bin/env bash
# Packs the tensor-parallel CUDA checks for a device call (issue 18) through
# scripts/gpu_engine_bundle.sh: test_cuda_tensor_parallel, test_nccl_communicator,
# test_cuda_engine (the one-rank path) and the veloxquant CLI, built with NCCL (-DVQ_NCCL=ON;
# libnccl.so.2, 218 MB, is not packed: gpu_tp_run.sh finds the host's), beside
# scripts/gpu_tp_run.sh, and the same programs without NCCL in DIR/nonccl/ (BUILD-nonccl), which
# gpu_tp_run.sh uses where the host has no libnccl.so.2.
#
#   scripts/gpu_tp_bundle.sh [DIR (gpu-tp-bundle)] [BUILD (build-cuda)]
#   then on the GPU host, from a checkout:  bash DIR/gpu_tp_run.sh
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-gpu-tp-bundle}
build=${2:-build-cuda}
export VQ_BUNDLE_TESTS="test_cuda_tensor_parallel test_nccl_communicator test_cuda_engine"
export VQ_BUNDLE_RUN=scripts/gpu_tp_run.sh
VQ_BUNDLE_CMAKE="-DVQ_NCCL=ON" scripts/gpu_engine_bundle.sh "$dir" "$build"
VQ_BUNDLE_CMAKE="-DVQ_NCCL=OFF" scripts/gpu_engine_bundle.sh "$dir/nonccl" "$build-nonccl"
