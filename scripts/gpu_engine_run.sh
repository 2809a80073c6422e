#!/usr/bin/env bash
# On a GPU host, from a checkout holding a bundle of scripts/gpu_engine_bundle.sh (issue 13):
#   check: the engine's GPU tests (test_cuda_engine, test_cuda_eval), `eval kld` and `eval passkey`
#          on the shipped model on the CPU (--matmul bf16) and on the CUDA engine, and
#          `bench --phases` on a random Llama-3-8B-shaped model (tools/make_llama_shapes.py):
#          1 x 4K and 1 x 32K real prefill + decode, 8 x 32K decode over synthetic caches;
#   bench: the benchmark of README "Many prompts, devices": 8 x 32K for full, skvq K4V4, skvq
#          K2V2, snapkv and snapkv+skvq and the largest batch the planner fits at 32K for full,
#          K4V4 and K2V2 (decode over --synthetic-prefill caches), 1 x 32K real prefill (full,
#          K2V2), 1 x 4K (full, K4V4, K2V2), tools/bench_transformers.py at 8 x 32K, then
#          test_cuda_eval but its passkey test; each part cut off by its own limit so one call
#          holds them all;
#   fit:   bench --max-batch-fit at 32K (prefill step 8192) for full and skvq K2V2, one method
#          per process, progress on stderr;
#   passkey: test_cuda_eval's passkey test (CPU and CUDA answers), cut off at PASSKEY_LIMIT s;
#   writes: the row-write batch tests and bench with and without --no-batch-writes at 8 x 32K and
#          at the largest batch at 32K (prefill step 8192), --phases, the plan at step 512.
# Output: OUT (default DIR/out): log.txt and one JSON per run (at most 8 files).
set -uo pipefail
mode=${1:-check}
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
git -C "$root" log --oneline -1 2>/dev/null
run() {  # label, timeout, command...
  local label=$1 limit=$2
  shift 2
  echo "=== $label: $*" >&2
  SECONDS=0
  timeout "$limit" "$@"
  echo "=== $label rc=$? ${SECONDS}s" >&2
}
make8b() {
  run make_llama_shapes 60 python3 "$root/tools/make_llama_shapes.py" "$M8" --preset 8b
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
    print("  %-40s batch %4d fits %4d prefill %9.0f tok/s decode %8.1f tok/s %5.1f%% of bound "
          "peak dev %6.1f GiB" % (m["method"], m["batch"], m["plan"]["max_sequences"],
          r.get("prefill_tokens_per_s", 0), r.get("decode_tokens_per_s", 0),
          r.get("decode_pct_of_bound", 0), r.get("peak_device_bytes", 0) / 2**30))
    if r:
        st, n = r["decode_seconds"], r["decode_steps"]
        f = r["first_decode_step_seconds"]
        print("    synthetic fill %.1f s; first decode step %.1f ms; later steps %.2f ms each "
              "(steady %.1f tok/s, %.1f%% of bound)" % (r["synthetic_fill_seconds"], f * 1e3,
              (st - f) / max(n - 1, 1) * 1e3, r["steady_decode_tokens_per_s"],
              r["steady_decode_pct_of_bound"]))
    steps = {}
    for p in m.get("phases", []):
        k = "decode" if p["decode"] else "prefill"
        steps.setdefault(k, []).append(p)
    for k, ps in steps.items():
        tot = sum(p["gpu_seconds"] for p in ps) / ps[0]["steps"] * 1e3
        print("    %s phases (%d steps, %.3f ms/step on the device):" % (k, ps[0]["steps"], tot))
        for p in ps:
            print("      %-26s device %8.3f ms host %8.3f ms" % (p["phase"],
                  p["gpu_seconds"] / p["steps"] * 1e3, p["host_seconds"] / p["steps"] * 1e3))
    print("    copy bandwidth %.1f GB/s" % (r.get("copy_bandwidth_bytes_per_s", 0) / 1e9))
PY
}
cd /tmp/vqe
if [ "$mode" = check ]; then
  run test_cuda_engine 90 ./test_cuda_engine
  make8b
  bench phases_4k 60 --methods full --batch 1 --context 4096 --gen 32 --prefill-step 4096 --phases
  bench phases_32k 70 --methods full --batch 1 --context 32768 --gen 8 --prefill-step 8192 --phases
  bench phases_8x32k 70 --methods full,skvq:bits_key=2:bits_value=2 --batch 8 \
    --context 32768 --gen 16 --prefill-step 32768 --synthetic-prefill --phases
  run test_cuda_eval 100 ./test_cuda_eval
  cd "$root"
  E="--methods snapkv:budget=256,skvq:bits_key=4:bits_value=4,snapkv+skvq:budget=256 --quiet --json"
  for d in cuda cpu; do
    run "eval kld $d" 40 "$V" eval kld $E --docs 4 -P 1024 -T 128 --matmul bf16 --device "$d" \
      >"$out/eval_kld_$d.json"
  done
  for d in cuda cpu; do
    run "eval passkey $d" 40 "$V" eval passkey $E --prompts 24 --matmul bf16 --device "$d" \
      >"$out/eval_passkey_$d.json"
  done
fi
if [ "$mode" = bench ]; then
  make8b
  S=budget=1024:scoring=query:pool_kernel=15:keep_window=true:evict_at=prompt_end
  Q=skvq:bits_key=4:bits_value=4,skvq:bits_key=2:bits_value=2
  ALL=full,$Q,snapkv:$S,snapkv+skvq:$S:bits_key=4:bits_value=4
  bench bench_8x32k 75 --methods "$ALL" --batch 8 --context 32768 --gen 16 --prefill-step 32768 \
    --synthetic-prefill
  bench bench_max32k 70 --methods "full,$Q" --max-batch-fit --context 32768 --gen 16 \
    --prefill-step 32768 --synthetic-prefill
  bench bench_1x32k 40 --methods full,skvq:bits_key=2:bits_value=2 --batch 1 --context 32768 \
    --gen 4 --prefill-step 8192
  bench bench_1x4k 35 --methods "full,$Q" --batch 1 --context 4096 --gen 32 --prefill-step 4096
  cd "$root"
  run "transformers 8x32k" 60 python3 tools/bench_transformers.py "$M8" --batch 8 \
    --context 32768 --gen 16 --repeats 1 --out "$out/transformers_8x32k.json"
  cd /tmp/vqe
  run test_cuda_eval 60 ./test_cuda_eval --gtest_filter=-*Passkey*
fi
if [ "$mode" = fit ]; then  # the largest batch at 32K, each method alone, progress on stderr
  [ -d "$M8" ] || make8b
  nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader
  for m in full skvq:bits_key=2:bits_value=2; do
    run "fit $m" 60 "$V" bench --device cuda --model "$M8" --no-check-weights --methods "$m" \
      --max-batch-fit --context 32768 --gen 16 --prefill-step 8192 --synthetic-prefill
  done
fi
if [ "$mode" = writes ]; then  # batched cache row writes (EngineOptions::batch_cache_writes)
  for t in test_cuda_row_writes test_cuda_caches test_cuda_decode_batch test_cuda_engine; do
    run "$t" 150 ./"$t" 2>&1 |
      grep -E "^\[  (PASSED|FAILED) |FAILED TEST|Failure|differ|error|batched vs" | head -40
  done
  run test_cuda_eval 60 ./test_cuda_eval --gtest_filter=-*Passkey* 2>&1 | tail -4
  make8b
  Q=skvq:bits_key=4:bits_value=4,skvq:bits_key=2:bits_value=2
  B="--context 32768 --gen 16 --synthetic-prefill"
  bench writes_8x32k 60 --methods "full,$Q" --batch 8 --prefill-step 32768 $B
  bench nowrites_8x32k 60 --methods "full,$Q" --batch 8 --prefill-step 32768 $B --no-batch-writes
  bench writes_max32k 100 --methods "full,$Q" --max-batch-fit --prefill-step 8192 $B
  bench nowrites_max32k 60 --methods skvq:bits_key=2:bits_value=2 --max-batch-fit \
    --prefill-step 8192 $B --no-batch-writes
  bench writes_phases 60 --methods full,skvq:bits_key=2:bits_value=2 --batch 8 \
    --prefill-step 32768 $B --phases
  run "plan, prefill step 512" 30 "$V" bench --device cuda --model "$M8" --no-check-weights \
    --methods "full,$Q" --max-batch-fit --context 32768 --gen 16 --plan-only
fi
if [ "$mode" = passkey ]; then  # the CPU and CUDA passkey answers (test_cuda_eval), long limit
  run "test_cuda_eval Passkey" "${PASSKEY_LIMIT:-240}" ./test_cuda_eval --gtest_filter=*Passkey*
fi
echo "done: $mode"
