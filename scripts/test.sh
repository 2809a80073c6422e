#!/usr/bin/env bash
# The whole test suite, as CI runs it: installs dependencies, builds and runs the GoogleTest suite
# (Release), again under AddressSanitizer + UndefinedBehaviorSanitizer, runs the fuzz smoke test,
# compiles the CUDA backend where nvcc exists (compile only: no GPU here), and first checks that
# every C++/CUDA source is formatted as .clang-format says.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
jobs=$(nproc)
export CTEST_OUTPUT_ON_FAILURE=1

echo "== [0/4] format: clang-format --dry-run -Werror on every C++/CUDA source =="
git ls-files '*.cpp' '*.h' '*.cu' '*.cuh' | xargs clang-format --dry-run -Werror

echo "== [1/4] CUDA backend: compile only =="
if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="$PATH:/usr/local/cuda/bin"
  cmake -S . -B build-cuda -DCMAKE_BUILD_TYPE=Release -DVQ_CUDA=ON -DVQ_BUILD_TESTS=ON \
        -DVQ_BUILD_BENCH=ON >/dev/null
  # Only the CUDA library, the GPU test programs and the GPU benchmark (the CPU targets are built
  # and run below); the GPU tests skip without a device, so they are compiled, not run, here.
  cuda_targets=(vq_cuda cuda_decode_attention)
  for f in tests/cuda/test_*.cpp; do [ -e "$f" ] && cuda_targets+=("$(basename "$f" .cpp)"); done
  cmake --build build-cuda -j"$jobs" --target "${cuda_targets[@]}"
  # Without a GPU every GPU test must skip cleanly (and pass where a device exists).
  for t in "${cuda_targets[@]}"; do
    case "$t" in test_*) build-cuda/tests/"$t" --gtest_brief=1 ;; esac
  done
else
  echo "nvcc not found: skipping the CUDA compile job"
fi

echo "== [2/4] fuzz smoke =="
if [ -x scripts/fuzz_smoke.sh ]; then scripts/fuzz_smoke.sh; else echo "no fuzz targets yet"; fi

echo "== [3/4] sanitizers (ASan + UBSan) =="
cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DVQ_SANITIZE=ON -DVQ_BUILD_BENCH=OFF \
      >/dev/null
cmake --build build-asan -j"$jobs"
(cd build-asan && ASAN_OPTIONS=detect_leaks=1 ctest -j"$jobs" --timeout 900)

echo "== [4/4] test suite (Release) =="
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$jobs"
(cd build && ctest -j"$jobs" --timeout 600)
