#!/usr/bin/env python3
"""PyTorch scaled_dot_product_attention beside the CUDA decode benchmark.

Runs SDPA decode (one query per sequence, GQA 32/8, head_dim 128) over a bf16 cache of the same
shapes as bench/cuda_decode_attention.cu (batch 1 and 8, context 4K/32K/128K) and a causal 32K
prefill, with the same protocol (warm-up, CUDA events, L2 flushed before each repeat by a pass
over 256 MiB: --flush read, the default, or write, as tools/gpu_timing.py says; median and
p10-p90), then reads that program's CSV and prints one Markdown table with every method's speed
against SDPA, and the issue's targets with the measured ratios.

Usage: python3 tools/bench_sdpa.py cuda_decode_attention.csv [--repeats 30] [--quick]
                                  [--before OLD.csv] [--skip-prefill] [--hq 32|128]
                                  [--shapes 1x4096,8x32768] [--flush read|write]
--before adds the medians of another build's CSV (same run, same machine state) and their ratio
to SDPA; --skip-prefill leaves out the 32K causal prefill (the cache-maintenance reference);
--hq: query heads (128: the GQA-16 shape of issue 14; the CSV must come from
cuda_decode_attention --hq of the same value); --shapes: the (batch x context) pairs timed.
"""
import argparse
import csv

import torch
import torch.nn.functional as F

from gpu_timing import time_it  # tools/gpu_timing.py, beside this file

HQ, HKV, D = 32, 8, 128


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--before", default="")
    ap.add_argument("--skip-prefill", action="store_true")
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--shapes", default="")
    ap.add_argument("--flush", choices=("read", "write"), default="read",
                    help="L2 flush before each repeat (tools/gpu_timing.py)")
    args = ap.parse_args()
    global HQ
    HQ = args.hq
    want = {tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",") if s}

    rows = list(csv.DictReader(open(args.csv)))
    before = {}
    if args.before:
        for r in csv.DictReader(open(args.before)):
            if r["kind"] == "decode":
                before[(int(r["batch"]), int(r["context"]), r["method"])] = float(r["median_us"])
    copy = next(r for r in rows if r["kind"] == "copy")
    copy_tbps = float(copy["tbps"])
    dev = torch.device("cuda")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name()}")

    sdpa = {}
    ctxs = [4096, 32768] if args.quick else [4096, 32768, 131072]
    for b in (1, 8):
        for ctx in ctxs:
            if want and (b, ctx) not in want:
                continue
            q = torch.randn(b, HQ, 1, D, device=dev, dtype=torch.bfloat16)
            k = torch.randn(b, HKV, ctx, D, device=dev, dtype=torch.bfloat16)
            v = torch.randn(b, HKV, ctx, D, device=dev, dtype=torch.bfloat16)
            fn = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
            med, p10, p90 = time_it(fn, flush, 5, args.repeats, args.flush)
            nbytes = 2 * k.numel() * 2 + 2 * q.numel() * 2
            sdpa[(b, ctx)] = (med, p10, p90, nbytes)
            del q, k, v
    torch.cuda.empty_cache()

    # causal prefill at 32K (B 1): the reference time for the cache-maintenance operations
    pre = None
    if not args.skip_prefill:
        n = 32768
        q = torch.randn(1, HQ, n, D, device=dev, dtype=torch.bfloat16)
        k = torch.randn(1, HKV, n, D, device=dev, dtype=torch.bfloat16)
        v = torch.randn(1, HKV, n, D, device=dev, dtype=torch.bfloat16)
        pre = time_it(
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
            flush, 3, max(5, args.repeats // 3), args.flush)
        del q, k, v

    print(f"\n## Decode attention on the H200 (H_q {HQ}, H_kv {HKV}, D {D}): veloxquant fused "
          "kernels vs PyTorch SDPA (bf16)\n")
    extra = " before us | before vs SDPA |" if before else ""
    print("| batch | context | method | median us | p10-p90 us | MB read | TB/s | % of copy BW | "
          "speed-up vs SDPA |" + extra)
    print("|---|---|---|---|---|---|---|---|---|" + ("---|---|" if before else ""))
    dec = [r for r in rows if r["kind"] == "decode"]
    for b in (1, 8):
        for ctx in ctxs:
            if (b, ctx) not in sdpa:
                continue
            med, p10, p90, nb = sdpa[(b, ctx)]
            tb = nb / (med * 1e-6) / 1e12
            print(f"| {b} | {ctx} | torch SDPA bf16 | {med:.1f} | {p10:.1f}-{p90:.1f} | "
                  f"{nb / 1e6:.1f} | {tb:.2f} | {100 * tb / copy_tbps:.0f}% | 1.00x |"
                  + (" | |" if before else ""))
            for r in dec:
                if int(r["batch"]) != b or int(r["context"]) != ctx:
                    continue
                m = float(r["median_us"])
                print(f"| {b} | {ctx} | {r['method']} | {m:.1f} | "
                      f"{float(r['p10_us']):.1f}-{float(r['p90_us']):.1f} | "
                      f"{float(r['bytes']) / 1e6:.1f} | {float(r['tbps']):.2f} | "
                      f"{float(r['pct_copy']):.0f}% | {med / m:.2f}x |", end="")
                o = before.get((b, ctx, r["method"]))
                if before:
                    print(f" {o:.1f} | {med / o:.2f}x |" if o else " | |", end="")
                print()
    print(f"\nCopy bandwidth (cudaMemcpy D2D, read + write) in the same run: {copy_tbps:.2f} TB/s")

    def dec_row(b, ctx, method):
        for r in dec:
            if int(r["batch"]) == b and int(r["context"]) == ctx and r["method"] == method:
                return r
        return None

    print("\n## Targets\n")
    print("| target | measured | met |\n|---|---|---|")
    r = dec_row(8, 32768, "fp16 full")
    if r and (8, 32768) in sdpa:
        ratio = sdpa[(8, 32768)][0] / float(r["median_us"])
        print(f"| fp16 fused decode >= 90% of SDPA throughput at 8 x 32K | {100 * ratio:.0f}% | "
              f"{'yes' if ratio >= 0.9 else 'no'} |")
    for ctx in (32768, 131072):
        r = dec_row(8, ctx, "skvq K2V2 g32")
        if r and (8, ctx) in sdpa:
            pct = float(r["pct_copy"])
            sp = sdpa[(8, ctx)][0] / float(r["median_us"])
            print(f"| skvq K2V2 >= 75% of copy bandwidth on its bytes at 8 x {ctx // 1024}K | "
                  f"{pct:.0f}% | {'yes' if pct >= 75 else 'no'} |")
            print(f"| skvq K2V2 >= 4x faster than SDPA bf16 at 8 x {ctx // 1024}K | {sp:.2f}x | "
                  f"{'yes' if sp >= 4 else 'no'} |")
    r = dec_row(1, 4096, "fp16 full")
    if r:
        m = float(r["median_us"])
        print(f"| batch-1 4K decode < 15 us per layer call (fp16) | {m:.1f} us | "
              f"{'yes' if m < 15 else 'no'} |")
    for name, label in (("skvq flush", "SKVQ flush"),
                        ("snapkv select key-proxy", "SnapKV selection (key proxy)"),
                        ("snapkv select query", "SnapKV selection (queries)")):
        r = next((x for x in rows if x["kind"] == "maint" and x["method"] == name), None)
        if r and pre:
            pct = 100 * float(r["median_us"]) / pre[0]
            print(f"| {label} at 32K <= 5% of prefill attention (SDPA causal 32K: "
                  f"{pre[0] / 1000:.2f} ms) | {float(r['median_us']):.0f} us = {pct:.1f}% | "
                  f"{'yes' if pct <= 5 else 'no'} |")


if __name__ == "__main__":
    main()
