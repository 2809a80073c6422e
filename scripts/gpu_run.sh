#!/usr/bin/env bash
# On a GPU host, from a checkout holding a bundle of scripts/gpu_bundle.sh: runs every GPU test
# program, then the decode benchmark with PyTorch SDPA beside it (tools/bench_sdpa.py) and the
# prefill benchmark with SDPA's causal prefill (bench/cuda_prefill_sdpa.py), all in one call so
# the ratios share one machine state. Logs go to OUT (default: DIR/out); a summary to stdout.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
out=${OUT:-$here/out}
mkdir -p "$out" /tmp/vq-gpu
tar xJf "$here/gpu.txz" -C /tmp/vq-gpu
export LD_LIBRARY_PATH=/tmp/vq-gpu/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
cd /tmp/vq-gpu
for t in test_cuda_decode test_cuda_decode_formats test_cuda_skvq test_cuda_snapkv \
  test_cuda_caches test_cuda_prefill; do
  SECONDS=0
  timeout 300 "./$t" >"$out/$t.txt" 2>&1
  echo "$t rc=$? ${SECONDS}s"
  grep -E "^\[(  FAILED|  PASSED|  SKIPPED)|worst|Failure|exception" "$out/$t.txt" | head -20
done
timeout 300 ./cuda_decode_attention --csv "$out/bench.csv" --repeats 20 >"$out/decode.txt" 2>&1
echo "decode bench rc=$?"
(cd "$root" && PYTHONUNBUFFERED=1 timeout 300 python3 tools/bench_sdpa.py "$out/bench.csv" \
  --repeats 20 >"$out/sdpa.txt" 2>&1)
echo "sdpa rc=$?"
sed -n '/^## Targets/,$p' "$out/sdpa.txt"
timeout 300 ./cuda_prefill_attention --repeats 5 >"$out/prefill.txt" 2>&1
echo "prefill bench rc=$?"
(cd "$root" && PYTHONUNBUFFERED=1 timeout 120 python3 bench/cuda_prefill_sdpa.py --repeats 5 \
  >"$out/prefill_sdpa.txt" 2>&1)
echo "prefill sdpa rc=$?"
