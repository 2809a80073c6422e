#!/usr/bin/env bash
# The newcomer's first run: installs what is needed, builds, then the main job: every cache
# method on one long prompt of the shipped evaluation data (the longest passkey prompt of
# data/eval/passkey.jsonl, about 1,800 tokens, its pass key hidden at mid-depth), each method's
# answer and KV cache memory side by side (`veloxquant compare`, README "Quick start"). About
# 10-30 s on 2 cores after the build.
#
# scripts/quickstart.sh --cuda: the GPU's main job instead (needs the CUDA toolkit, nvcc, and an
# NVIDIA GPU): builds build-cuda with VQ_CUDA=ON, then `veloxquant bench --device cuda` on the
# shipped model: 32 sequences of 1,792 random prompt tokens plus 64 generated at once per cache
# method, prefill and decode tokens/s, cache and device memory, and the decode bound.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = --cuda ]; then
  scripts/install_deps.sh
  export PATH=$PATH:/usr/local/cuda/bin
  command -v nvcc >/dev/null || { echo "quickstart --cuda: needs the CUDA toolkit (nvcc)" >&2; exit 1; }
  scripts/build.sh build-cuda -DVQ_CUDA=ON -DVQ_BUILD_TESTS=OFF -DVQ_BUILD_BENCH=OFF
  snap=scoring=query:pool_kernel=15:keep_window=true:evict_at=prompt_end
  exec ./build-cuda/veloxquant bench --device cuda --model models/vq-mini-llama --batch 32 \
    --context 1792 --gen 64 --prefill-step 1792 --methods "full,skvq:bits_key=4:bits_value=4,\
skvq:bits_key=2:bits_value=2,snapkv:budget=448:$snap,snapkv+skvq:budget=448:$snap:bits_key=4:bits_value=4"
fi
scripts/install_deps.sh
scripts/build.sh build
model=models/vq-mini-llama
if [ ! -f "$model/config.json" ]; then
  echo "quickstart: $model has no model (config.json absent); showing the synthetic cache demo" >&2
  exec ./build/veloxquant demo
fi
./build/veloxquant compare --model "$model" --passkey data/eval/passkey.jsonl --quiet
echo
echo "Next: ./build/veloxquant compare --help (your own prompt or methods), ./build/veloxquant"
echo "generate --help, ./build/veloxquant eval --help, and docs/RESULTS.md for the whole sweep."
