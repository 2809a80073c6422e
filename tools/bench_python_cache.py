#!/usr/bin/env python3
"""veloxquant.Cache inside transformers on a GPU, beside DynamicCache and QuantizedCache.

A random-initialised Llama-3-8B-shaped model (vocab 128256, hidden 4096, intermediate 14336, 32
layers, 32 query / 8 KV heads of head_dim 128, bf16; seeded, made on the GPU: no weights travel)
prefills random token ids of `--context` tokens per sequence at each batch size, then decodes
`--gen` tokens greedily, for each cache:
  dynamic   transformers' DynamicCache, attn_implementation "sdpa"
  quanto4 / quanto2
            transformers' QuantizedCache, backend "quanto" (optimum-quanto; residual 128,
            group 64, keys per channel as the KIVI-style default), "sdpa"
  vq:SPEC   veloxquant.Cache(SPEC), attn_implementation "veloxquant" (fused attention over the
            packed rows)
  vqc:SPEC  the same with the decode steps through torch.compile (inductor, CUDA graphs: mode
            "reduce-overhead", fullgraph, what transformers' generate uses for a compileable
            cache; python/veloxquant/compiled.py: the cache's step runs between the graphs)
  static    transformers' StaticCache with the same compiled decode steps and "sdpa": the
            fastest transformers decode, as a reference (no compression)
With --rounds N every cache runs N times, interleaved, and the table gives the run of median
decode rate with the rounds' range (at batch 1 a decode step is mostly the host's Python loop).
Per run: prefill tokens/s (one forward over the whole prompt, logits of the last token only),
decode tokens/s (batch x steps / wall time of the steps after two warm-up steps, host loop
included, as a user sees it; compiled kinds warm up for 4 steps: compiling, recording the
graphs), KV memory (torch.cuda.memory_allocated after the run minus before
it: what the cache holds at the end), and the peak (max_memory_allocated over the run minus the
memory allocated before it: cache plus activations). A run that fails (out of memory, a backend
missing) is reported with its error and the others go on.

  python3 tools/bench_python_cache.py --batches 1,8 --context 32768 --gen 32 --json out.json
"""
import argparse
import gc
import json
import time
import traceback

import torch

SHAPES = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
              num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
              rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=False)

DEFAULT_CACHES = ("dynamic,quanto4,quanto2,vq:full,vq:skvq:bits_key=4:bits_value=4,"
                  "vq:skvq:bits_key=2:bits_value=2,"
                  "vq:snapkv+skvq:keep=0.25:scoring=query:pool_kernel=15:keep_window=true:"
                  "evict_at=prompt_end:bits_key=4:bits_value=4")


DEV = "cuda"


def cache_kw(cache):
    """The keyword that hands a cache to forward: `cache` from transformers 5.3 on."""
    import inspect
    from transformers.models.llama.modeling_llama import LlamaModel
    name = "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters \
        else "past_key_values"
    return {name: cache}


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def allocated():
    return torch.cuda.memory_allocated() if DEV == "cuda" else 0


def peak_allocated():
    return torch.cuda.max_memory_allocated() if DEV == "cuda" else 0


def vq_resident(cache):
    """Bytes the veloxquant cache's own allocations hold (0 for the transformers caches)."""
    return int(cache.memory()["bytes_resident"]) if hasattr(cache, "memory") else 0


def make_model(layers):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(**dict(SHAPES, num_hidden_layers=layers))
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(DEV):
        model = LlamaForCausalLM(cfg)
    torch.set_default_dtype(prev)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    return model.eval()


_COMPILED = {}


def decode_forward(model, kind):
    """The decode step's callable: the model, or (vqc:, static) its compiled forward, made once
    (dynamo keeps one graph per attention implementation)."""
    if not (kind.startswith("vqc:") or kind == "static"):
        return model
    if "f" not in _COMPILED:
        _COMPILED["f"] = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    return _COMPILED["f"]


def make_cache(kind, model, context, batch, extra):
    if kind == "static":
        from transformers import StaticCache
        return StaticCache(config=model.config, max_cache_len=context + extra), "sdpa"
    if kind == "dynamic":
        from transformers import DynamicCache
        return DynamicCache(), "sdpa"
    if kind.startswith("quanto"):
        from transformers import QuantizedCache
        bits = int(kind[len("quanto"):])
        return QuantizedCache(backend="quanto", config=model.config, nbits=bits), "sdpa"
    if kind.startswith("vq:") or kind.startswith("vqc:"):
        import veloxquant
        spec = kind.split(":", 1)[1]
        if ":keep=" in spec:  # keep=F: that fraction of the prompt, as the CLI's --methods
            head, rest = spec.split(":keep=", 1)
            frac, _, tail = rest.partition(":")
            budget = max(1, int(round(float(frac) * context)))
            spec = f"{head}:budget={budget}" + (f":{tail}" if tail else "")
        return veloxquant.Cache(spec), "veloxquant"
    raise ValueError(f"unknown cache kind {kind!r}")


def set_attn(model, impl):
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(impl)
    else:
        model.config._attn_implementation = impl


def run_one(model, kind, batch, context, gen):
    sync()
    gc.collect()
    if DEV == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base = allocated()
    compiled = kind.startswith("vqc:") or kind == "static"
    warm, steps = (4 if compiled else 2), gen
    cache, impl = make_cache(kind, model, context, batch, warm + steps + 1)
    set_attn(model, impl)
    fwd = decode_forward(model, kind)
    g = torch.Generator(device=DEV).manual_seed(1234)
    ids = torch.randint(0, SHAPES["vocab_size"], (batch, context), device=DEV, generator=g)
    with torch.no_grad():
        sync()
        t0 = time.perf_counter()
        out = model(input_ids=ids, **cache_kw(cache), use_cache=True, logits_to_keep=1)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        sync()
        t_prefill = time.perf_counter() - t0
        del out
        vq_prompt = vq_resident(cache)
        kv_prompt = allocated() - base + vq_prompt
        # positions passed as generate passes them (a compiled step reads no host counter)
        pos = torch.arange(context, context + warm + steps, device=DEV).view(1, -1)
        for i in range(warm + steps):
            if i == warm:
                sync()
                t1 = time.perf_counter()
            out = fwd(input_ids=nxt, position_ids=pos[:, i:i + 1].expand(batch, 1),
                      **cache_kw(cache), use_cache=True, logits_to_keep=1)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            del out
        sync()
        t_decode = time.perf_counter() - t1
    kv_end = allocated() - base + vq_resident(cache)
    # Our caches allocate with cudaMalloc, outside torch's allocator: their resident bytes are
    # added (at the prompt's end, the most an evicting cache holds, for the peak).
    peak = peak_allocated() - base + max(vq_resident(cache), vq_prompt)
    fp16_kv = (2 * batch * SHAPES["num_key_value_heads"] * SHAPES["head_dim"] * 2 *
               model.config.num_hidden_layers * (context + warm + steps))
    row = dict(cache=kind, batch=batch, context=context, gen=steps,
               prefill_tok_s=batch * context / t_prefill, decode_tok_s=batch * steps / t_decode,
               decode_ms_per_step=1000.0 * t_decode / steps, kv_bytes_after_prompt=kv_prompt,
               kv_bytes_end=kv_end, peak_bytes=peak, bf16_kv_bytes=fp16_kv)
    del cache, ids, nxt
    return row


def median_rows(runs):
    """One row per (cache, batch): the run of median decode rate among its rounds (an error row
    when every round failed), with the spread of the rounds' decode rates."""
    rows = []
    for key in dict.fromkeys((r["cache"], r["batch"]) for r in runs):
        mine = [r for r in runs if (r["cache"], r["batch"]) == key]
        ok = sorted((r for r in mine if "error" not in r), key=lambda r: r["decode_tok_s"])
        if not ok:
            rows.append(dict(mine[0]))
            continue
        row = dict(ok[(len(ok) - 1) // 2])  # the lower median: a measured run, not an average
        row["rounds"] = len(ok)
        row["decode_tok_s_min"], row["decode_tok_s_max"] = ok[0]["decode_tok_s"], ok[-1]["decode_tok_s"]
        rows.append(row)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--layers", type=int, default=SHAPES["num_hidden_layers"])
    ap.add_argument("--caches", default=DEFAULT_CACHES)
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every cache this many times, interleaved (cache 1, 2, ..., then "
                         "again), and report the median decode rate: at batch 1 the step is the "
                         "host's Python loop, whose speed drifts with whatever else the host runs")
    ap.add_argument("--json", default="")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU, 2 layers of hidden 256 (a check of the script, no figures)")
    args = ap.parse_args()
    global DEV
    if args.smoke:
        DEV = "cpu"
        SHAPES.update(vocab_size=512, hidden_size=256, intermediate_size=512,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64)
        args.layers = 2

    import transformers
    info = dict(torch=torch.__version__, transformers=transformers.__version__,
                device=torch.cuda.get_device_name() if DEV == "cuda" else "cpu", layers=args.layers)
    try:
        import veloxquant
        info["veloxquant_cuda"] = bool(veloxquant._veloxquant.cuda_built())
    except Exception as e:  # reported, the peers still run
        info["veloxquant_error"] = repr(e)
    print(json.dumps(info), flush=True)
    model = make_model(args.layers)
    info["weight_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    rows = []
    expanded = [k for k in args.caches.split(",") if k]  # specs use colons, never commas
    runs = []
    for batch in [int(b) for b in args.batches.split(",")]:
        for rnd in range(args.rounds):
            for kind in expanded:
                try:
                    row = run_one(model, kind, batch, args.context, args.gen)
                except Exception as e:
                    row = dict(cache=kind, batch=batch, context=args.context,
                               error=f"{type(e).__name__}: {str(e)[:300]}")
                    traceback.print_exc(limit=2)
                row["round"] = rnd
                runs.append(row)
                print(json.dumps(row), flush=True)
    rows = median_rows(runs)
    # Ratios against DynamicCache of the same batch, in one run.
    for r in rows:
        ref = next((x for x in rows if x["cache"] == "dynamic" and x["batch"] == r["batch"]
                    and "error" not in x), None)
        if ref and "error" not in r and ref["kv_bytes_end"] > 0:
            r["kv_vs_dynamic"] = r["kv_bytes_end"] / ref["kv_bytes_end"]
            r["decode_vs_dynamic"] = r["decode_tok_s"] / ref["decode_tok_s"]
    print("| cache | batch | prefill tok/s | decode tok/s | vs dynamic | KV end GiB | vs dynamic |"
          " peak GiB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if "error" in r:
            print(f"| `{r['cache']}` | {r['batch']} | {r['error']} |")
            continue
        spread = (f" ({r['decode_tok_s_min']:.1f}-{r['decode_tok_s_max']:.1f})"
                  if r.get("rounds", 1) > 1 else "")
        print(f"| `{r['cache']}` | {r['batch']} | {r['prefill_tok_s']:.0f} | "
              f"{r['decode_tok_s']:.1f}{spread} | {r.get('decode_vs_dynamic', float('nan')):.2f} | "
              f"{r['kv_bytes_end'] / 2**30:.2f} | {r.get('kv_vs_dynamic', float('nan')):.3f} | "
              f"{r['peak_bytes'] / 2**30:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(info=info, rows=rows, runs=runs), f, indent=1)


if __name__ == "__main__":
    main()
