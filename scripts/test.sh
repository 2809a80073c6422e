#!/usr/bin/env bash
# The whole test suite, as CI runs it: installs dependencies, builds and runs the GoogleTest suite
# (Release), again under AddressSanitizer + UndefinedBehaviorSanitizer, runs the fuzz smoke test,
# compiles the CUDA backend where nvcc exists (compile only: no GPU here), first checks that
# every C++/CUDA source is formatted as .clang-format says, and last installs the Python package
# into a venv (pip install .) and runs its pytest suite (python/tests).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
jobs=$(nproc)
export CTEST_OUTPUT_ON_FAILURE=1

# The Python step's venv (torch from PyPI is ~3 GB with its CUDA libraries, mostly download and
# unpacking) is made in the background while the C++ jobs compile; step 5 waits for it.
py=build-python/venv/bin/python
mkdir -p build-python
(
  python3 -m venv build-python/venv &&
    $py -m pip install -q --upgrade pip &&
    $py -m pip install -q "torch>=2.4" "transformers>=5.2,<6" accelerate pytest safetensors numpy \
      "scikit-build-core>=0.10" "nanobind>=2.4"
) >build-python/venv.log 2>&1 &
venv_pid=$!

echo "== [0/5] format: clang-format --dry-run -Werror on every C++/CUDA source =="
git ls-files '*.cpp' '*.h' '*.cu' '*.cuh' | xargs clang-format --dry-run -Werror

echo "== [1/5] CUDA backend: compile only =="
if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="$PATH:/usr/local/cuda/bin"
  # Its own folder (build-cuda-ci), so a user's build-cuda keeps the flags it benchmarks with. A
  # compile check, not a build to run: host C++ at -O0 (step 4 builds and runs it at -O3) and the
  # device code to PTX only, unoptimised (90a-virtual, cicc -O0: no ptxas). Every template is still
  # instantiated and type-checked; one decode-kernel file took 8.7 s this way against 34 s for
  # optimised SASS (session 14, this 2-core machine). The GPU bundle (scripts/gpu_bundle.sh) builds
  # the real thing; a machine with a GPU JIT-compiles this PTX when the tests below run.
  cmake -S . -B build-cuda-ci -DCMAKE_BUILD_TYPE=Release -DVQ_CUDA=ON -DVQ_BUILD_TESTS=ON \
        -DVQ_BUILD_BENCH=ON -DCMAKE_CUDA_ARCHITECTURES=90a-virtual \
        -DCMAKE_CXX_FLAGS_RELEASE="-O0 -DNDEBUG" \
        -DCMAKE_CUDA_FLAGS_RELEASE="-O0 -Xcicc -O0 -DNDEBUG" >/dev/null
  # Only the CUDA library, the GPU test programs and the GPU benchmark (the CPU targets are built
  # and run below); the GPU tests skip without a device, so they are compiled, not run, here.
  cuda_targets=(vq_cuda cuda_decode_attention)
  for f in tests/cuda/test_*.cpp; do [ -e "$f" ] && cuda_targets+=("$(basename "$f" .cpp)"); done
  cmake --build build-cuda-ci -j"$jobs" --target "${cuda_targets[@]}"
  # Without a GPU every GPU test must skip cleanly (and pass where a device exists).
  for t in "${cuda_targets[@]}"; do
    case "$t" in test_*) build-cuda-ci/tests/"$t" --gtest_brief=1 ;; esac
  done
else
  echo "nvcc not found: skipping the CUDA compile job"
fi

echo "== [2/5] fuzz smoke =="
if [ -x scripts/fuzz_smoke.sh ]; then scripts/fuzz_smoke.sh; else echo "no fuzz targets yet"; fi

echo "== [3/5] sanitizers (ASan + UBSan) =="
# -O1 -g1 (line tables: enough for the sanitizers' stack traces): at RelWithDebInfo's -O2 -g, GCC
# took 290 s on src/ops/fused_attention.cpp alone against 24 s here, and the whole build 27 of
# CI's 60 minutes (session 12, this 2-core machine).
# The test programs themselves at -O0 (VQ_TEST_CXX_OPTIONS): their code is assertions and small
# references, the library they exercise stays at -O1; test_eval.cpp took 53 s at -O1, 17 s at -O0.
cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DVQ_SANITIZE=ON -DVQ_BUILD_BENCH=OFF \
      -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" -DVQ_TEST_CXX_OPTIONS=-O0 >/dev/null
cmake --build build-asan -j"$jobs"
# Three sweeps run in step 4 only: under the sanitizers they took 495 of the suite's 1,263 test
# seconds (177 s, 159 s and 158 s against 3.9 s, 24.8 s and 3.1 s at -O3; session 12's CI), and
# the code they sweep (tensor-parallel eval, packed and GQA fused attention) is exercised here by
# the smaller tests of the same paths (TensorParallel.*, FusedAttention.*, BackendOps.Attention*).
asan_skip='^(EvalTensorParallel.TwoRanksGiveTheSamePasskeyAnswers|BackendOps.AttentionPackedDecodePaths|FusedAttention.ManyQueriesPerHead)$'
(cd build-asan && ASAN_OPTIONS=detect_leaks=1 ctest -j"$jobs" --timeout 900 -E "$asan_skip")

echo "== [4/5] test suite (Release) =="
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$jobs"
(cd build && ctest -j"$jobs" --timeout 600)

echo "== [5/5] Python package: pip install . into a venv, pytest python/tests =="
# A fresh venv under build-python/ (ignored by git); torch from PyPI (its CPU-only wheel index is
# not reachable from CI), transformers and pytest, then the package itself (scikit-build-core
# builds the extension in build-python/<wheel tag>, with ccache where present). The shipped-model
# test compares with build/veloxquant, built in step 4. kvpress pins transformers < 5.3: its test
# runs in a second venv that sees the first one's packages (a .pth) under its own transformers.
py_start=$SECONDS
if ! wait "$venv_pid"; then
  cat build-python/venv.log >&2
  echo "Python step: making the venv failed (log above)" >&2
  exit 1
fi
launcher=()
if command -v ccache >/dev/null 2>&1; then launcher=(CMAKE_CXX_COMPILER_LAUNCHER=ccache); fi
env "${launcher[@]}" CMAKE_BUILD_PARALLEL_LEVEL="$jobs" $py -m pip install -q --no-build-isolation .
VQ_CLI="$PWD/build/veloxquant" $py -m pytest -q python/tests
python3 -m venv build-python/venv-kvpress
$py -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > \
  "$(build-python/venv-kvpress/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/zz_veloxquant_venv.pth"
kvpy=build-python/venv-kvpress/bin/python
$kvpy -m pip install -q kvpress
# The first venv's transformers brings its own `kernels` (0.19 with transformers 5.25), which
# the older transformers kvpress pins cannot construct its kernel table with ("Either a revision
# or a version must be specified", at import): this venv gets the `kernels` its transformers
# asks for (its "kernels" extra), shadowing the other.
kernels_spec=$($kvpy -c 'import importlib.metadata as m
print(next((r.split(";")[0].replace(" ", "") for r in m.requires("transformers") or []
            if r.startswith("kernels") and "extra == \"kernels\"" in r), ""))')
if [ -n "$kernels_spec" ]; then $kvpy -m pip install -q "$kernels_spec"; fi
$kvpy -m pytest -q python/tests/test_kvpress.py
echo "Python step: $((SECONDS - py_start)) s"
