#!/usr/bin/env bash
# On a GPU host, from a checkout holding a bundle of scripts/gpu_tp_bundle.sh (issue 18): the
# tensor-parallel CUDA tests (N = 2 simulated ranks against N = 1, the device all-reduce, NCCL
# with one rank, N = 2 over real devices where there are two), the one-rank engine's tests, and
# `generate` / `bench` with --tensor-parallel 2 --tp-simulate on the shipped model.
# libnccl.so.2: the programs link it; it is taken from the host's Python NCCL wheel
# (nvidia-nccl-cu13, under torch's venv: python3 -c 'import nvidia.nccl') or the CUDA toolkit.
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0). Output: OUT (default DIR/out)/log.txt.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(pwd)
out=${OUT:-$here/out}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export LD_LIBRARY_PATH=/tmp/vqtp/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
nccl=$(python3 -c 'import os, nvidia.nccl as m; print(os.path.join(list(m.__path__)[0], "lib"))' 2>/dev/null)
for d in "$nccl" /usr/local/cuda/lib64 /usr/local/cuda/lib \
  /opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib; do
  [ -n "$d" ] && [ -d "$d" ] && LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$d
done
bundle=$here/gpu.txz
rm -rf /tmp/vqtp && mkdir -p /tmp/vqtp && tar xJf "$bundle" -C /tmp/vqtp
if ldd /tmp/vqtp/test_cuda_tensor_parallel | grep -q "libnccl.*not found"; then
  bundle=$here/nonccl/gpu.txz
  echo "no libnccl.so.2 on this host: the bundle without NCCL ($bundle)"
  rm -rf /tmp/vqtp && mkdir -p /tmp/vqtp && tar xJf "$bundle" -C /tmp/vqtp
fi
export VQ_SOURCE_DIR=$root VQ_MODEL_DIR=$root/models/vq-mini-llama
log=$out/log.txt
exec > >(tee -a "$log") 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "libnccl from: $nccl"
ldd /tmp/vqtp/test_nccl_communicator | grep -E "nccl|cublas|not found"
run() {  # label, timeout, command...
  local label=$1 limit=$2
  shift 2
  echo "=== $label: $*"
  SECONDS=0
  timeout "$limit" "$@"
  echo "=== $label rc=$? ${SECONDS}s"
}
V=/tmp/vqtp/veloxquant
run test_cuda_tensor_parallel 100 /tmp/vqtp/test_cuda_tensor_parallel
run test_nccl_communicator 20 /tmp/vqtp/test_nccl_communicator
run test_cuda_engine 45 /tmp/vqtp/test_cuda_engine
run generate-tp2-sim 15 "$V" generate --device cuda --tensor-parallel 2 --tp-simulate \
  --cache skvq:bits_key=4:bits_value=4:rotation=hadamard \
  --prompt "The capital of France is" --max-tokens 24
run generate-tp1 15 "$V" generate --device cuda --cache skvq:bits_key=4:bits_value=4:rotation=hadamard --prompt "The capital of France is" --max-tokens 24
run generate-tp2-real 10 "$V" generate --device cuda --tensor-parallel 2 --prompt "x" --max-tokens 1
run bench-tp2-sim 25 "$V" bench --device cuda --tensor-parallel 2 --tp-simulate \
  --methods full,skvq:bits_key=2:bits_value=2 --batch 4 --context 1024 --gen 16 --json
