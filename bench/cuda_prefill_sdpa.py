"""PyTorch SDPA causal prefill beside bench/cuda_prefill_attention.cu (same shapes: B 1, 32 query
heads, 8 KV heads, head_dim 128, bf16, contexts 4K and 32K): the tensor-core reference time the
SKVQ flush and SnapKV selection are meant to be compared with. One warm-up, then CUDA-event
timings; prints median, min and max in ms. Run on the GPU machine (needs torch with CUDA).
Usage: python3 bench/cuda_prefill_sdpa.py [--repeats N]
"""
import argparse

import torch
import torch.nn.functional as F


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name(0)}")
    print("| context | op | median ms | min ms | max ms |\n|---|---|---|---|---|")
    for n in (4096, 32768):
        q = torch.randn(1, 32, n, 128, device=dev, dtype=torch.bfloat16)
        k = torch.randn(1, 8, n, 128, device=dev, dtype=torch.bfloat16)
        v = torch.randn(1, 8, n, 128, device=dev, dtype=torch.bfloat16)

        def fn():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(args.repeats):
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        times.sort()
        print(f"| {n} | torch SDPA bf16 causal prefill | {times[len(times) // 2]:.3f} | "
              f"{times[0]:.3f} | {times[-1]:.3f} |")
        del q, k, v


if __name__ == "__main__":
    main()
