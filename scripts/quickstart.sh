#!/usr/bin/env bash
# The newcomer's first run: installs what is needed, builds, then the main job: every cache
# method on one long prompt of the shipped evaluation data (the longest passkey prompt of
# data/eval/passkey.jsonl, about 1,800 tokens, its pass key hidden at mid-depth), each method's
# answer and KV cache memory side by side (`veloxquant compare`, README "Quick start"). About
# 10-30 s on 2 cores after the build.
set -euo pipefail
cd "$(dirname "$0")/.."
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
