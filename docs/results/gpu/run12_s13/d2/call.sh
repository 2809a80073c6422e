#!/usr/bin/env bash
# s13 call 2 (issues 13, 14): s13-lead with the four helper branches merged (snap_decode_budget,
# per-layer key lists, skvq_protect on the device, attn-error and scoring=external on eval
# --device cuda) and the batched decode launch's balanced pieces (a group of more than 32
# sequences runs as balanced launches whose splits are sized for the piece; d1 measured K2V2 at
# batch 123 fall from 1604.7 to 962.7 tok/s with pieces of 32 + rest sized for one launch).
# Every GPU test program, memcheck over the batched and protect tests, eval attn-error and
# scoring=external on both devices, then the engine: old (main) against new.
here=$(cd "$(dirname "$0")" && pwd)
root=$(pwd)
o=$OUT
export PATH=$PATH:/usr/local/cuda/bin
rm -rf /tmp/d2 && mkdir -p /tmp/d2 && tar xJf "$here/gpu.txz" -C /tmp/d2
export LD_LIBRARY_PATH=/tmp/d2/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
for d in /usr/local/cuda/lib64 /opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib; do
  [ -e "$d/libcublas.so.13" ] && LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$d
done
export VQ_SOURCE_DIR=$root VQ_MODEL_DIR=$root/models/vq-mini-llama
cd /tmp/d2
exec > >(tee -a "$o/run.txt") 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
t() {  # label, limit, command...
  local label=$1 limit=$2; shift 2
  SECONDS=0; timeout "$limit" "$@" >/tmp/d2/log_$label.txt 2>&1; local rc=$?
  echo "== $label rc=$rc ${SECONDS}s"
  grep -E "^\[(  FAILED|  PASSED)|worst|Failure|FAILED TEST|\] per op" /tmp/d2/log_$label.txt | head -24
  [ $rc -eq 0 ] || { grep -B2 -A12 "Failure" /tmp/d2/log_$label.txt | head -60 > $o/fail_$label.txt; }
}
for p in test_cuda_decode_batch test_cuda_decode test_cuda_engine test_cuda_caches test_cuda_skvq \
         test_cuda_snapkv test_backend_ops_cuda test_cuda_tensor_parallel test_cuda_eval; do
  [ -x ./$p ] && t $p 200 ./$p
done
SECONDS=0
timeout 150 compute-sanitizer --tool memcheck --error-exitcode 86 --print-limit 20 \
  ./test_cuda_decode_batch >/tmp/d2/san.txt 2>&1
echo "== memcheck test_cuda_decode_batch rc=$? ${SECONDS}s $(grep -E 'ERROR SUMMARY' /tmp/d2/san.txt | tail -1) $(grep -E '^\[  PASSED' /tmp/d2/san.txt)"
SECONDS=0
timeout 150 compute-sanitizer --tool memcheck --error-exitcode 86 --print-limit 20 \
  ./test_cuda_caches --gtest_filter='CudaCaches.SkvqProtect*' >/tmp/d2/san2.txt 2>&1
echo "== memcheck test_cuda_caches SkvqProtect rc=$? ${SECONDS}s $(grep -E 'ERROR SUMMARY' /tmp/d2/san2.txt | tail -1) $(grep -E '^\[  PASSED' /tmp/d2/san2.txt)"
# eval on both devices (helper's comparison commands), the shipped model
(cd "$root" && for d in cpu cuda; do
  SECONDS=0
  timeout 120 /tmp/d2/veloxquant eval attn-error --device $d --methods full,streaming:budget=128,snapkv:budget=128,skvq:bits_key=4:bits_value=4 -P 512 -T 32 --docs 1 --matmul bf16 --quiet 2>&1 | tail -12
  echo "== attn-error $d rc=${PIPESTATUS[0]} ${SECONDS}s"
  SECONDS=0
  timeout 120 /tmp/d2/veloxquant eval ppl --device $d --methods "snapkv:budget=128:scoring=external:evict_at=prompt_end" -P 512 -T 64 --docs 1 --matmul bf16 --quiet 2>&1 | tail -6
  echo "== ppl external $d rc=${PIPESTATUS[0]} ${SECONDS}s"
done)
M8=/tmp/llama8b
timeout 60 python3 "$root/tools/make_llama_shapes.py" "$M8" --preset 8b | tail -1
bench() {  # binary (old|new), json name, limit, bench args...
  local bin=$1 name=$2 limit=$3; shift 3
  SECONDS=0
  timeout "$limit" ./veloxquant_$bin bench --device cuda --model "$M8" --no-check-weights --json "$@" \
    >"$o/${name}_$bin.json" 2>/tmp/d2/$name.err
  echo "== bench $name $bin rc=$? ${SECONDS}s"; tail -2 /tmp/d2/$name.err
  python3 - "$o/${name}_$bin.json" <<'PY'
import json, sys
try:
    j = json.load(open(sys.argv[1]))
except Exception as e:
    print("  (no JSON:", e, ")"); sys.exit(0)
for m in j["methods"]:
    r = m.get("run", {})
    print("  %-40s batch %3d decode %7.1f (steady %7.1f) tok/s %5.1f%% (steady %5.1f%%) peak %5.1f GiB" % (
        m["method"], m["batch"], r.get("decode_tokens_per_s", 0), r.get("steady_decode_tokens_per_s", 0),
        r.get("decode_pct_of_bound", 0), r.get("steady_decode_pct_of_bound", 0),
        r.get("peak_device_bytes", 0) / 2**30))
    for p in m.get("phases", []):
        if p["decode"] and p["phase"] in ("attention", "cache update"):
            print("    %-26s device %7.3f ms host %7.3f ms" % (p["phase"], p["gpu_seconds"] / p["steps"] * 1e3,
                  p["host_seconds"] / p["steps"] * 1e3))
PY
}
B="--batch 8 --context 32768 --gen 16 --prefill-step 32768 --synthetic-prefill"
M3="full,skvq:bits_key=4:bits_value=4,skvq:bits_key=2:bits_value=2"
bench new b8x32k 120 --methods "$M3" $B
bench old b8x32k 120 --methods "$M3" $B
L="--context 32768 --gen 16 --synthetic-prefill"
bench new k2v2_b123 200 --methods skvq:bits_key=2:bits_value=2 --batch 123 $L
bench old k2v2_b123 200 --methods skvq:bits_key=2:bits_value=2 --batch 123 $L
bench new full_b29 150 --methods full --batch 29 $L
bench new protect_8x32k 150 --methods "skvq:bits_key=2:bits_value=2:protect=0.01,skvq:bits_key=2:bits_value=2:protect=0.01:protect_scoring=key_proxy" --batch 8 --context 32768 --gen 16 --prefill-step 4096 --synthetic-prefill --phases
