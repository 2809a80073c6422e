#!/usr/bin/env bash
# Our runtime against llama.cpp on the shipped model, same machine, same thread count.
#
#   tools/llama_cpp/compare.sh [threads (2)] [repeats (3)] [our build dir (build)]
#
# 1. Gets llama.cpp from the llama-cpp-python source package on PyPI (pip download; the package
#    vendors llama.cpp) into .cache/llama_cpp/ and builds only llama-bench (Release, native).
# 2. Converts models/vq-mini-llama to GGUF in bf16 (tools/llama_cpp/hf_to_gguf.py, using the
#    gguf-py that comes with that llama.cpp; llama.cpp's own converter needs torch).
# 3. llama-bench, flash attention on (needed for quantized V caches), K/V cache f16, q8_0 and
#    q4_0: prefill of 512/1024/2048 tokens (-p N -n 0) and 32 decode tokens after a context of
#    512/1024/2048 (-p 0 -n 32 -d N).
# 4. Our bench_e2e for the full cache (fp16 K/V) and the compressed caches at the same contexts
#    and threads (bench_e2e's default methods, whose skvq is the seed's K2V2, and skvq K4V4, the
#    cache to set beside llama.cpp's q4_0), then one Markdown table: tokens/s of each and our
#    ratios to llama.cpp f16 and q4_0.
#    Every cache runs in both matrix-product modes (--matmul exact,bf16, alternating within each
#    repeat): "veloxquant <cache>" is the exact fp32 mode (the default), "veloxquant <cache>
#    (bf16 matmul)" the opt-in bf16 mode (activations rounded to bf16, fp32 sums: llama.cpp's
#    arithmetic on this bf16 GGUF).
# llama.cpp runs its OpenMP threads with the runtime's default wait policy (spin briefly at a
# barrier, then sleep), the right setting on a dedicated machine; on a shared, oversubscribed
# machine export OMP_WAIT_POLICY=passive for it. Ours decodes on its own worker pool
# (src/ops/thread_pool.h: spin up to 100 us, then sleep), which that variable does not touch.
set -euo pipefail
cd "$(dirname "$0")/../.."
threads=${1:-2}
repeats=${2:-3}
build=${3:-build}
version=0.3.36
work=.cache/llama_cpp
mkdir -p "$work"
src=$work/llama_cpp_python-$version/vendor/llama.cpp
if [ ! -d "$src" ]; then
  python3 -m pip download --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$work" >/dev/null
  tar xzf "$work/llama_cpp_python-$version.tar.gz" -C "$work"
fi
bench=$work/build/bin/llama-bench
if [ ! -x "$bench" ]; then
  cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_OPENSSL=OFF >/dev/null
  cmake --build "$work/build" -j"$(nproc)" --target llama-bench >/dev/null
fi
gguf=$work/vq-mini-llama.bf16.gguf
[ -f "$gguf" ] || python3 tools/llama_cpp/hf_to_gguf.py models/vq-mini-llama "$gguf" \
  --gguf-py "$src/gguf-py"

for ct in f16 q8_0 q4_0; do
  "$bench" -m "$gguf" -t "$threads" -r "$repeats" -fa 1 -ctk "$ct" -ctv "$ct" \
    -p 512,1024,2048 -n 0 -o json >"$work/pp_$ct.json"
  "$bench" -m "$gguf" -t "$threads" -r "$repeats" -fa 1 -ctk "$ct" -ctv "$ct" \
    -p 0 -n 32 -d 512,1024,2048 -o json >"$work/tg_$ct.json"
done
"$build/bench/bench_e2e" --threads "$threads" --repeats "$repeats" --decode 32 \
  --methods "full;snapkv:budget=256;skvq;skvq:bits_key=4:bits_value=4;snapkv+skvq:budget=256;streaming:window=256" \
  --matmul exact,bf16 --csv "$work/ours.csv" >"$work/ours.md"

python3 - "$work" <<'PY'
import csv, json, sys
work = sys.argv[1]
ll = {}
for ct in ("f16", "q8_0", "q4_0"):
    for kind in ("pp", "tg"):
        for r in json.load(open(f"{work}/{kind}_{ct}.json")):
            ctx = r["n_prompt"] if kind == "pp" else r["n_depth"]
            ll[(kind, ct, ctx)] = (r["avg_ts"], r["stddev_ts"])
ours = list(csv.DictReader(open(f"{work}/ours.csv")))
print(open(f"{work}/ours.md").read())
print("| context | engine / cache | prefill tok/s | decode tok/s | prefill vs llama.cpp f16 | decode vs llama.cpp f16 | decode vs llama.cpp q4_0 |")
print("|---:|---|---:|---:|---:|---:|---:|")
for ctx in (512, 1024, 2048):
    p16, t16 = ll[("pp", "f16", ctx)][0], ll[("tg", "f16", ctx)][0]
    tq4 = ll[("tg", "q4_0", ctx)][0]
    for ct in ("f16", "q8_0", "q4_0"):
        p, ps = ll[("pp", ct, ctx)]
        t, ts = ll[("tg", ct, ctx)]
        print(f"| {ctx} | llama.cpp {ct} | {p:.0f} ± {ps:.0f} | {t:.1f} ± {ts:.1f} | {p / p16:.2f} | {t / t16:.2f} | {t / tq4:.2f} |")
    for r in ours:
        if int(r["context"]) != ctx:
            continue
        p, t = float(r["prefill_mean"]), float(r["decode_mean"])
        mode = " (bf16 matmul)" if r.get("matmul", "exact") == "bf16" else ""
        print(f"| {ctx} | veloxquant {r['method']}{mode} | {p:.0f} ± {float(r['prefill_sd']):.0f} | "
              f"{t:.1f} ± {float(r['decode_sd']):.1f} | {p / p16:.2f} | {t / t16:.2f} | {t / tq4:.2f} |")
PY
