#!/usr/bin/env bash
# The main job: installs what is needed, builds, and generates text with the model that ships in
# models/ under every cache method's default settings (SnapKV + SKVQ composed shown last), then
# prints the memory table of the cache demo.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
scripts/build.sh build
model=$(ls -d models/*/ 2>/dev/null | head -n 1 || true)
if [ -n "$model" ] && [ -f "$model/config.json" ] && ./build/veloxquant generate --help >/dev/null 2>&1; then
  prompt="The LORD is my shepherd; I shall not want. He maketh me to lie down in green pastures:"
  ./build/veloxquant generate --model "$model" --cache snapkv+skvq --prompt "$prompt" --max-tokens 48
fi
./build/veloxquant demo
