#!/usr/bin/env python3
"""transformers' generate beside `veloxquant bench` (issue 13): the same weights folder, batch and
context, random prompt ids; prefill tokens/s, decode tokens/s and peak memory, as JSON.

Loads the folder (e.g. tools/make_llama_shapes.py --preset 8b) with AutoModelForCausalLM in bf16
and attn_implementation="sdpa", then per repeat: a batch of --batch prompts of --context random
ids (seeded, in [0, vocab), no padding: every sequence has the same length) through one
model.generate call, greedy, min_new_tokens = max_new_tokens = --gen (no EOS stop), with
generate's default cache (a DynamicCache for these models; the JSON records the cache class the
call returned). A streamer timestamps the call: prefill = start -> the first generated tokens
(the prompt's forward and one sampling), decode = those -> the end, (gen - 1) steps of batch
tokens. Prefill tokens/s = batch x context / prefill time; decode tokens/s =
batch x (gen - 1) / decode time. Medians over --repeats after one warm-up call. Peak memory:
torch.cuda.max_memory_allocated on cuda, the process's peak RSS on cpu (weights included).

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
import transformers
from transformers import AutoModelForCausalLM
from transformers.generation.streamers import BaseStreamer


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


class Clock(BaseStreamer):
    """Timestamps generate's streamer calls: the prompt first, then each step's new tokens."""

    def __init__(self, device):
        self.device, self.times = device, []

    def put(self, value):
        sync(self.device)
        self.times.append(time.perf_counter())

    def end(self):
        pass


def timed_generate(model, ids, new_tokens, device):
    """(prefill seconds, decode seconds, cache class name) of one generate call."""
    clock = Clock(device)
    sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            use_cache=True,
            pad_token_id=0,
            streamer=clock,
            return_dict_in_generate=True,
        )
    sync(device)
    t_end = time.perf_counter()
    assert out.sequences.shape[1] == ids.shape[1] + new_tokens, out.sequences.shape
    # times[0]: the prompt handed over; times[1]: the first generated tokens (after prefill).
    assert len(clock.times) == 1 + new_tokens, len(clock.times)
    cache = out["cache"] if "cache" in out else out.get("past_key_values")  # 5.x renames it
    return clock.times[1] - t0, t_end - clock.times[1], type(cache).__name__


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

    major = int(transformers.__version__.split(".")[0])
    dtype_kw = "dtype" if major >= 5 else "torch_dtype"
    model = AutoModelForCausalLM.from_pretrained(
        args.model_dir, attn_implementation="sdpa", **{dtype_kw: torch.bfloat16}).to(args.device)
    model.eval()
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, vocab, (args.batch, args.context), generator=g).to(args.device)

    timed_generate(model, ids, 2, args.device)  # warm-up (kernels, allocator)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    runs = [timed_generate(model, ids, args.gen, args.device) for _ in range(args.repeats)]
    tp = statistics.median(r[0] for r in runs)
    td = statistics.median(r[1] for r in runs)
    cache_class = runs[0][2]
    peak = (torch.cuda.max_memory_allocated() if args.device == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    result = {
        "engine": "transformers",
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "model": args.model_dir,
        "device": args.device,
        "dtype": "bfloat16",
        "attn_implementation": "sdpa",
        "cache": cache_class,
        "batch": args.batch,
        "context": args.context,
        "gen": args.gen,
        "repeats": args.repeats,
        "prefill_seconds": tp,
        "prefill_tokens_per_s": args.batch * args.context / tp,
        "decode_seconds": td,
        "decode_tokens_per_s": args.batch * (args.gen - 1) / td,
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
