#!/usr/bin/env bash
# Session 9, eng13 (issue 13): the CUDA engine with caches reserved up front and one batched
# decode-attention launch per layer. On the GPU host, from the checkout, beside a bundle of
# scripts/gpu_engine_bundle.sh (VQ_BUNDLE_TESTS = the tests below) in DIR/gpu.txz:
#   bash DIR/run.sh   the decode / engine / eval GPU tests; bench at 8 x 32K (full, skvq K4V4,
#                     skvq K2V2 over --synthetic-prefill caches) as built and with --no-reserve
#                     --no-batch-decode in the same call; the largest batch at 32K (full, K2V2;
#                     planner at --prefill-step 8192); bench --phases at 8 x 32K; then the
#                     Passkey test of test_cuda_eval (cut off at PASSKEY_LIMIT s)
# Output: OUT: log.txt and one JSON per bench (at most 8 files).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(pwd)
out=${OUT:-$here/out}
mkdir -p "$out"
rm -rf /tmp/vqe && mkdir -p /tmp/vqe && tar xJf "$here/gpu.txz" -C /tmp/vqe
export LD_LIBRARY_PATH=/tmp/vqe/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
for d in /usr/local/cuda/lib64 /opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib; do
  [ -e "$d/libcublas.so.13" ] && LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$d
done
export VQ_SOURCE_DIR=$root VQ_MODEL_DIR=$root/models/vq-mini-llama
V=/tmp/vqe/veloxquant
M8=/tmp/llama8b
log=$out/log.txt
exec > >(tee -a "$log") 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.total --format=csv,noheader
run() {  # label, timeout, command...
  local label=$1 limit=$2
  shift 2
  echo "=== $label: $*" >&2
  SECONDS=0
  timeout "$limit" "$@"
  echo "=== $label rc=$? ${SECONDS}s" >&2
}
gtest() {  # program, timeout, args...: the summary lines only
  local t=$1 limit=$2
  shift 2
  echo "=== $t $*"
  SECONDS=0
  timeout "$limit" ./"$t" "$@" >/tmp/"$t".txt 2>&1
  local rc=$?
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\] .* ran|FAILED TEST|Failure|differs|error|Expected|Which is|worst|batched vs|sequence [0-9]" /tmp/"$t".txt | head -60
  echo "=== $t rc=$rc ${SECONDS}s"
}
bench() {  # json name, timeout, bench args...
  local name=$1 limit=$2
  shift 2
  run "bench $name" "$limit" "$V" bench --device cuda --model "$M8" --no-check-weights --json \
    "$@" >"$out/$name.json"
  python3 - "$out/$name.json" <<'PY'
import json, sys
try:
    j = json.load(open(sys.argv[1]))
except Exception as e:
    print("  (no JSON:", e, ")"); sys.exit(0)
for m in j["methods"]:
    r = m.get("run", {})
    print("  %-28s batch %3d fits %3d decode %8.1f tok/s %5.1f%% of bound peak dev %6.1f GiB"
          % (m["method"], m["batch"], m["plan"]["max_sequences"], r.get("decode_tokens_per_s", 0),
             r.get("decode_pct_of_bound", 0), r.get("peak_device_bytes", 0) / 2**30))
    if r:
        st, n, f = r["decode_seconds"], r["decode_steps"], r["first_decode_step_seconds"]
        print("    first decode step %.1f ms; later steps %.2f ms each (steady %.1f tok/s, %.1f%% "
              "of bound); copy bandwidth %.1f GB/s" % (f * 1e3, (st - f) / max(n - 1, 1) * 1e3,
              r["steady_decode_tokens_per_s"], r["steady_decode_pct_of_bound"],
              r.get("copy_bandwidth_bytes_per_s", 0) / 1e9))
    steps = {}
    for p in m.get("phases", []):
        steps.setdefault("decode" if p["decode"] else "prefill", []).append(p)
    for k, ps in steps.items():
        tot = sum(p["gpu_seconds"] for p in ps) / ps[0]["steps"] * 1e3
        print("    %s phases (%d steps, %.3f ms/step on the device):" % (k, ps[0]["steps"], tot))
        for p in ps:
            print("      %-26s device %8.3f ms host %8.3f ms" % (p["phase"],
                  p["gpu_seconds"] / p["steps"] * 1e3, p["host_seconds"] / p["steps"] * 1e3))
PY
}
Q=skvq:bits_key=4:bits_value=4,skvq:bits_key=2:bits_value=2
K2=skvq:bits_key=2:bits_value=2
cd /tmp/vqe
gtest test_cuda_decode_batch 60
gtest test_cuda_decode 60
gtest test_backend_ops_cuda 90
gtest test_cuda_engine 120
gtest test_cuda_eval 60 --gtest_filter=-*Passkey*
run make_llama_shapes 60 python3 "$root/tools/make_llama_shapes.py" "$M8" --preset 8b
bench b8x32k_after 90 --methods "full,$Q" --batch 8 --context 32768 --gen 16 \
  --prefill-step 32768 --synthetic-prefill
bench b8x32k_before 90 --methods "full,$Q" --batch 8 --context 32768 --gen 16 \
  --prefill-step 32768 --synthetic-prefill --no-reserve --no-batch-decode
bench max32k_after 90 --methods "full,$K2" --max-batch-fit --context 32768 --gen 16 \
  --prefill-step 8192 --synthetic-prefill
bench phases_8x32k 60 --methods "full,$K2" --batch 8 --context 32768 --gen 16 \
  --prefill-step 32768 --synthetic-prefill --phases
gtest test_cuda_eval "${PASSKEY_LIMIT:-80}" --gtest_filter=*Passkey*
echo "done"
