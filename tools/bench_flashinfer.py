#!/usr/bin/env python3
"""FlashInfer's paged decode beside the CUDA decode benchmark (the peers of issue 14, same call).

Runs flashinfer.BatchDecodeWithPagedKVCacheWrapper, both its default decode kernel (the CUDA-core
one, use_tensor_cores=False) and its tensor-core one (use_tensor_cores=True, rows "... tc"; NHD
pages of 16 rows), over a bf16 and an fp8-e4m3 paged cache of the shapes of bench/cuda_decode_attention.cu
(32 query / 8 KV heads, head_dim 128; batch 1 and 8; context 4K, 32K, 128K) with that program's
protocol (warm-up, CUDA events, L2 flushed by a pass over 256 MiB before each repeat, read or
written as --flush says (tools/gpu_timing.py), median and
p10-p90), then prints one Markdown table per shape with our rows from that program's CSV beside
them (% of copy bandwidth on each row's bytes, its bound in us = bytes / copy bandwidth) and the
issue's peer targets. FlashInfer's JIT kernels are built once, before any timing (the first plan
and run of each data type), in FLASHINFER_WORKSPACE_BASE.

Usage: python3 tools/bench_flashinfer.py cuda_decode_attention.csv [--repeats 20] [--quick]
                                       [--hq 32|128] [--shapes 1x4096,8x32768]
                                       [--flush read|write]
(--hq: query heads, 128 for issue 14's GQA-16 shape, with a CSV of cuda_decode_attention --hq of
the same value; --shapes: the (batch x context) pairs timed, default all)
Exits 0 with a note when flashinfer cannot be imported. The wheels are fetched once into .whl/
(ignored) and carried to the GPU host in a peers bundle (VQ_BUNDLE=peers scripts/gpu_bundle.sh),
whose gpu_run.sh installs them:
  python3 -m pip download --no-deps -d .whl flashinfer-python==0.6.18
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 -d .whl "apache-tvm-ffi>=0.1.6,<0.2,!=0.1.8,!=0.1.8.post0"
"""
import argparse
import csv
import sys
import time

import torch

from gpu_timing import time_it  # tools/gpu_timing.py, beside this file

HQ, HKV, D, PAGE = 32, 8, 128, 16


def make_case(fi, ws, b, ctx, kv_dtype, dev, tc=False):
    """A wrapper planned for b sequences of ctx rows, its query and paged cache."""
    pages_per_seq = (ctx + PAGE - 1) // PAGE
    n_pages = b * pages_per_seq
    indptr = torch.arange(0, b + 1, dtype=torch.int32, device=dev) * pages_per_seq
    indices = torch.arange(0, n_pages, dtype=torch.int32, device=dev)
    last = torch.full((b,), ctx - (pages_per_seq - 1) * PAGE, dtype=torch.int32, device=dev)
    kv = torch.randn(n_pages, 2, PAGE, HKV, D, device=dev, dtype=torch.bfloat16)
    if kv_dtype != torch.bfloat16:
        kv = kv.to(kv_dtype)
    q = torch.randn(b, HQ, D, device=dev, dtype=torch.bfloat16)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tc)
    w.plan(indptr, indices, last, HQ, HKV, D, PAGE, pos_encoding_mode="NONE",
           q_data_type=torch.bfloat16, kv_data_type=kv_dtype)
    nbytes = kv.numel() * kv.element_size() + 2 * q.numel() * 2
    return w, q, kv, nbytes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--shapes", default="")
    ap.add_argument("--flush", choices=("read", "write"), default="read",
                    help="L2 flush before each repeat (tools/gpu_timing.py)")
    args = ap.parse_args()
    global HQ
    HQ = args.hq
    want = {tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",") if s}
    rows = list(csv.DictReader(open(args.csv)))
    copy_tbps = float(next(r for r in rows if r["kind"] == "copy")["tbps"])
    try:
        import flashinfer as fi
    except Exception as e:  # noqa: BLE001 - report and leave the other rows standing
        print(f"flashinfer: not importable ({type(e).__name__}: {e}); no peer rows")
        return 0
    dev = torch.device("cuda")
    torch.manual_seed(0)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    print(f"flashinfer {fi.__version__}, torch {torch.__version__}, "
          f"device {torch.cuda.get_device_name()}")
    kinds = (("FlashInfer bf16", torch.bfloat16, False),
             ("FlashInfer fp8 e4m3", torch.float8_e4m3fn, False),
             ("FlashInfer bf16 tc", torch.bfloat16, True),
             ("FlashInfer fp8 e4m3 tc", torch.float8_e4m3fn, True))
    # JIT: build each data type's kernels once before timing; a kernel that fails to build or run
    # is reported and left out (the other rows stand)
    ok = []
    for name, dt, tc in kinds:
        t0 = time.time()
        try:
            w, q, kv, _ = make_case(fi, ws, 1, 4096, dt, dev, tc)
            w.run(q, kv)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            print(f"JIT {name}: failed ({type(e).__name__}: {str(e)[:300]}); left out", flush=True)
            continue
        ok.append((name, dt, tc))
        print(f"JIT {name}: {time.time() - t0:.1f} s (build + first run)", flush=True)
        del w, q, kv
    kinds = ok
    ctxs = [4096, 32768] if args.quick else [4096, 32768, 131072]
    res = {}
    shapes = [(b, c) for b in (1, 8) for c in ctxs if not want or (b, c) in want]
    for b, ctx in shapes:
        for name, dt, tc in kinds:
            w, q, kv, nb = make_case(fi, ws, b, ctx, dt, dev, tc)
            med, p10, p90 = time_it(lambda: w.run(q, kv), flush, 5, args.repeats, args.flush)
            res[(b, ctx, name)] = (med, p10, p90, nb)
            del w, q, kv
            torch.cuda.empty_cache()

    ours = {(int(r["batch"]), int(r["context"]), r["method"]): r
            for r in rows if r["kind"] == "decode"}
    print(f"\n## Decode peers (same call, H_q {HQ}, H_kv {HKV}): FlashInfer paged decode beside "
          "ours\n")
    print("| batch | context | method | median us | p10-p90 us | MB read | % of copy BW | bound us |")
    print("|---|---|---|---|---|---|---|---|")
    for b, ctx in shapes:
        for name, _, _ in kinds:
            med, p10, p90, nb = res[(b, ctx, name)]
            tb = nb / (med * 1e-6) / 1e12
            print(f"| {b} | {ctx} | {name} | {med:.1f} | {p10:.1f}-{p90:.1f} | "
                  f"{nb / 1e6:.1f} | {100 * tb / copy_tbps:.0f}% | "
                  f"{nb / (copy_tbps * 1e12) * 1e6:.1f} |")
        for (bb, cc, m), r in sorted(ours.items()):
            if bb != b or cc != ctx:
                continue
            nb = float(r["bytes"])
            print(f"| {b} | {ctx} | {m} | {float(r['median_us']):.1f} | "
                  f"{float(r['p10_us']):.1f}-{float(r['p90_us']):.1f} | {nb / 1e6:.1f} | "
                  f"{float(r['pct_copy']):.0f}% | {nb / (copy_tbps * 1e12) * 1e6:.1f} |")
    print(f"\nCopy bandwidth (from the CSV, same run): {copy_tbps:.2f} TB/s")

    print("\n## Peer targets (issue 14)\n")
    print("| target | measured | met |\n|---|---|---|")
    for b, ctx in shapes:
        r = ours.get((b, ctx, "fp16 full"))
        fbs = [res[k][0] for k in res if k[:2] == (b, ctx) and "bf16" in k[2]]
        if r and fbs:  # against the faster of FlashInfer's two bf16 kernels
            fb = min(fbs)
            m = float(r["median_us"])
            print(f"| fp16 >= FlashInfer bf16 (faster kernel) at {b} x {ctx // 1024}K | "
                  f"{m:.1f} vs {fb:.1f} us ({fb / m:.2f}x) | {'yes' if m <= fb else 'no'} |")
    r = ours.get((8, 32768, "skvq K4V4 g32"))
    f8s = [res[k][0] for k in res if k[:2] == (8, 32768) and "fp8" in k[2]]
    if r and f8s:  # against the faster of FlashInfer's two fp8 kernels
        f8 = min(f8s)
        sp = f8 / float(r["median_us"])
        print(f"| skvq K4V4 g32 >= 1.8x FlashInfer fp8 (faster kernel) at 8 x 32K | {sp:.2f}x | "
              f"{'yes' if sp >= 1.8 else 'no'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
