#!/usr/bin/env python3
"""transformers' generate beside `veloxquant bench` (issue 13): the same weights folder, batch and
context, random prompt ids; prefill tokens/s, decode tokens/s and peak memory, as JSON.

Loads the folder (e.g. tools/make_llama_shapes.py --preset 8b) with AutoModelForCausalLM in bf16
and attn_implementation="sdpa", then per repeat: a batch of --batch prompts of --context random
ids (seeded, in [0, vocab), no padding: every sequence has the same length) through
model.generate with a DynamicCache, greedy, min_new_tokens = max_new_tokens = --gen (no EOS stop).
Prefill time is one forward of the prompts (generate with max_new_tokens = 1, which prefills and
samples one token); decode time is the rest of the full run: (t(gen) - t(1)) for (gen - 1) steps
of batch tokens each. Prefill tokens/s = batch x context / t(1); decode tokens/s =
batch x (gen - 1) / (t(gen) - t(1)). Medians over --repeats after one warm-up. Peak memory:
torch.cuda.max_memory_allocated on cuda, the process's peak RSS on cpu.

  python3 tools/bench_transformers.py /tmp/llama-8b-shapes --device cuda --batch 8 \\
      --context 32768 --gen 32 --out transformers.json
  python3 tools/bench_transformers.py TINY_DIR --device cpu --batch 2 --context 64 --gen 4
"""
import argparse
import json
import resource
import statistics
import sys
import time

import torch
from transformers import AutoModelForCausalLM, DynamicCache


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def timed_generate(model, ids, new_tokens, device):
    sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            past_key_values=DynamicCache(),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            use_cache=True,
            pad_token_id=0,
        )
    sync(device)
    assert out.shape[1] == ids.shape[1] + new_tokens, out.shape
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--gen", type=int, default=32, help="generated tokens per sequence (>= 2)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write the JSON here too")
    args = ap.parse_args()
    if args.gen < 2:
        sys.exit("bench_transformers: --gen: expected >= 2 (decode is timed as gen - 1 steps)")
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_transformers: --device cuda: expected a CUDA device but torch sees none")

    model = AutoModelForCausalLM.from_pretrained(
        args.model_dir, torch_dtype=torch.bfloat16, attn_implementation="sdpa").to(args.device)
    model.eval()
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, vocab, (args.batch, args.context), generator=g).to(args.device)

    timed_generate(model, ids, 2, args.device)  # warm-up (kernels, allocator)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t_prefill, t_full = [], []
    for _ in range(args.repeats):
        t_prefill.append(timed_generate(model, ids, 1, args.device))
        t_full.append(timed_generate(model, ids, args.gen, args.device))
    tp, tf = statistics.median(t_prefill), statistics.median(t_full)
    peak = (torch.cuda.max_memory_allocated() if args.device == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    result = {
        "engine": "transformers",
        "transformers_version": __import__("transformers").__version__,
        "torch_version": torch.__version__,
        "model": args.model_dir,
        "device": args.device,
        "dtype": "bfloat16",
        "attn_implementation": "sdpa",
        "cache": "DynamicCache",
        "batch": args.batch,
        "context": args.context,
        "gen": args.gen,
        "repeats": args.repeats,
        "prefill_seconds": tp,
        "prefill_tokens_per_s": args.batch * args.context / tp,
        "decode_seconds": tf - tp,
        "decode_tokens_per_s": args.batch * (args.gen - 1) / (tf - tp) if tf > tp else 0.0,
        "peak_memory_bytes": peak,
        "peak_memory_kind": "torch.cuda.max_memory_allocated" if args.device == "cuda" else "peak RSS",
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
