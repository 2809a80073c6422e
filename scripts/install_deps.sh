#!/usr/bin/env bash
# Installs everything veloxquant needs on a fresh Debian 12 machine: the toolchain and libraries
# (Debian packages) and the Python packages used by the tools. Safe to re-run.
set -euo pipefail
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
PKGS=(build-essential cmake pkg-config g++ clang libclang-rt-14-dev
      libgtest-dev libgmock-dev libbenchmark-dev nlohmann-json3-dev libpcre2-dev libopenblas-dev
      libcli11-dev libfmt-dev libxxhash-dev python3 python3-pip python3-venv clang-format
      bible-kjv-text dict-gcide fortunes dict-foldoc dict-jargon dict-devil python3.11-doc)
missing=()
for p in "${PKGS[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  echo "[install_deps] apt-get install ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi
# Python packages for the tools (tokenizer goldens, corpus, charts); never needed by the library.
python3 -m pip install -q --disable-pip-version-check numpy tokenizers safetensors 2>/dev/null \
  || python3 -m pip install -q --break-system-packages numpy tokenizers safetensors
