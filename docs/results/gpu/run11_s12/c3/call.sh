#!/usr/bin/env bash
# s12 call 3 (issues 16, 13): branch s12-chan (CUDA channel-axis SKVQ keys: device flush, fused
# decode and prefill attention over channel-axis records) merged with main: every GPU test
# program, compute-sanitizer memcheck over the channel-axis tests, the engine with channel-axis
# keys at 8 x 32K beside token-axis K2V2, and `--phases` at 8 x 32K for full, snapkv and
# snapkv+skvq (where the step's time goes).
here=$(cd "$(dirname "$0")" && pwd)
root=$(pwd)
o=$OUT
export PATH=$PATH:/usr/local/cuda/bin
rm -rf /tmp/c3 && mkdir -p /tmp/c3 && tar xJf "$here/gpu.txz" -C /tmp/c3
export LD_LIBRARY_PATH=/tmp/c3/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
for d in /usr/local/cuda/lib64 /opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib; do
  [ -e "$d/libcublas.so.13" ] && LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$d
done
export VQ_SOURCE_DIR=$root VQ_MODEL_DIR=$root/models/vq-mini-llama
cd /tmp/c3
exec > >(tee -a "$o/run.txt") 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
t() {  # label, limit, command...
  local label=$1 limit=$2; shift 2
  SECONDS=0; timeout "$limit" "$@" >/tmp/c3/log_$label.txt 2>&1; local rc=$?
  echo "== $label rc=$rc ${SECONDS}s"
  grep -E "^\[(  FAILED|  PASSED)|worst|Failure|FAILED TEST|\] per op|\[cuda\]" /tmp/c3/log_$label.txt | head -24
  [ $rc -eq 0 ] || { grep -B2 -A12 "Failure" /tmp/c3/log_$label.txt | head -60 > $o/fail_$label.txt; }
}
for p in test_cuda_skvq test_cuda_caches test_cuda_prefill test_cuda_decode test_cuda_decode_batch \
         test_cuda_snapkv test_backend_ops_cuda test_cuda_engine; do
  [ -x ./$p ] && t $p 150 ./$p
done
SECONDS=0
timeout 120 compute-sanitizer --tool memcheck --error-exitcode 86 --print-limit 20 ./test_cuda_skvq \
  --gtest_filter=*Channel* >/tmp/c3/san.txt 2>&1
echo "== memcheck test_cuda_skvq *Channel* rc=$? ${SECONDS}s $(grep -E 'ERROR SUMMARY' /tmp/c3/san.txt | tail -1) $(grep -E '^\[  PASSED' /tmp/c3/san.txt)"
[ -x ./veloxquant ] || exit 0
M8=/tmp/llama8b
timeout 60 python3 "$root/tools/make_llama_shapes.py" "$M8" --preset 8b | tail -1
bench() {  # json name, limit, bench args...
  local name=$1 limit=$2; shift 2
  SECONDS=0
  timeout "$limit" ./veloxquant bench --device cuda --model "$M8" --no-check-weights --json "$@" \
    >"$o/$name.json" 2>/tmp/c3/$name.err
  echo "== bench $name rc=$? ${SECONDS}s"; tail -2 /tmp/c3/$name.err
  python3 - "$o/$name.json" <<'PY'
import json, sys
try:
    j = json.load(open(sys.argv[1]))
except Exception as e:
    print("  (no JSON:", e, ")"); sys.exit(0)
for m in j["methods"]:
    r = m.get("run", {})
    print("  %-70s batch %3d decode %7.1f (steady %7.1f) tok/s %5.1f%% (steady %5.1f%%) peak %5.1f GiB" % (
        m["method"], m["batch"], r.get("decode_tokens_per_s", 0), r.get("steady_decode_tokens_per_s", 0),
        r.get("decode_pct_of_bound", 0), r.get("steady_decode_pct_of_bound", 0),
        r.get("peak_device_bytes", 0) / 2**30))
    steps = [p for p in m.get("phases", []) if p["decode"]]
    for p in steps:
        print("    %-26s device %7.3f ms host %7.3f ms" % (p["phase"], p["gpu_seconds"] / p["steps"] * 1e3,
              p["host_seconds"] / p["steps"] * 1e3))
PY
}
B="--batch 8 --context 32768 --gen 16 --prefill-step 32768 --synthetic-prefill"
CH=skvq:bits_key=2:bits_value=2:key_axis=channel:rotation=hadamard:meta=fp8_e4m3:key_rows=32
bench chan_8x32k 120 --methods "skvq:bits_key=2:bits_value=2,$CH" $B
S=budget=1024:scoring=query:pool_kernel=15:keep_window=true:evict_at=prompt_end
bench phases_8x32k 120 --methods "full,snapkv:$S,snapkv+skvq:$S:bits_key=4:bits_value=4" $B --phases
cd "$root"
E="--methods skvq:bits_key=2:bits_value=2,$CH --quiet --json --docs 4 -P 1024 -T 128 --matmul bf16"
for d in cuda cpu; do
  SECONDS=0; timeout 60 /tmp/c3/veloxquant eval kld $E --device "$d" >"$o/kld_$d.json" 2>/tmp/c3/kld_$d.err
  echo "== eval kld $d rc=$? ${SECONDS}s"; tail -2 /tmp/c3/kld_$d.err
done
