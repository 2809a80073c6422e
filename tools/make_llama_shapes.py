#!/usr/bin/env python3
"""Writes a random-initialised model with Llama-3.2-1B's or Llama-3-8B's shapes in bf16 (not committed).

--preset 1b (default), from Llama-3.2-1B's public config.json: vocab 128256, hidden 2048,
intermediate 8192, 16 layers, 32 query heads and 8 KV heads of head_dim 64, tied embeddings,
rope_theta 500000 with llama3 rope scaling (factor 32, original context 8192): 1.24 B parameters,
2.47 GB in bf16.
--preset 8b, Llama-3-8B's tensor shapes: vocab 128256, hidden 4096, intermediate 14336, 32 layers,
32 query heads and 8 KV heads of head_dim 128, untied lm_head, rope_theta 500000; with Llama-3.1-8B's
llama3 rope scaling (factor 8, original context 8192) and max_position_embeddings 131072 so 32K and
128K contexts are valid positions: 8.03 B parameters, 16.06 GB in bf16.
RMSNorm eps 1e-5, norm weights 1. Other weights are N(0, std) values in bf16: a table of 65536
seeded normal draws (times std, rounded to bf16, nearest even) indexed by seeded random uint16s,
so the writer only draws random bits (SFC64, one stream per 16 M-element piece seeded by
(seed, tensor, piece): the same bytes whatever the threads or shards) and gathers, on every core
(--threads), pieces written in order with a bounded number in flight, so the script needs little
memory. The distribution is the table's (65536 normal samples).
The safetensors files are written directly (numpy has no bf16 dtype): header JSON padded to 8
bytes, tensors in order. No tokenizer: prompt the model with token ids.

  python3 tools/make_llama_shapes.py /tmp/llama-1b-shapes [--shards 2] [--layers 16]
  python3 tools/make_llama_shapes.py /tmp/llama-8b-shapes --preset 8b --shards 4
  build/veloxquant generate --model /tmp/llama-1b-shapes --prompt-ids 128000,791,1401,374 \\
      --max-tokens 8 --ignore-eos        # the summary's last line is the peak RSS
"""
import argparse
import collections
import concurrent.futures
import json
import os
import struct
import time

import numpy as np

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 16,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}


PRESETS = {
    "1b": CONFIG,
    "8b": dict(
        CONFIG,
        head_dim=128,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        rope_scaling={"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                      "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        tie_word_embeddings=False,
    ),
}


def tensor_list(cfg):
    """(name, shape, kind) in checkpoint order; kind is 'norm' (ones) or 'w' (random)."""
    h, i, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    out = [("model.embed_tokens.weight", (cfg["vocab_size"], h), "w")]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        out += [
            (p + "input_layernorm.weight", (h,), "norm"),
            (p + "self_attn.q_proj.weight", (q, h), "w"),
            (p + "self_attn.k_proj.weight", (kv, h), "w"),
            (p + "self_attn.v_proj.weight", (kv, h), "w"),
            (p + "self_attn.o_proj.weight", (h, q), "w"),
            (p + "post_attention_layernorm.weight", (h,), "norm"),
            (p + "mlp.gate_proj.weight", (i, h), "w"),
            (p + "mlp.up_proj.weight", (i, h), "w"),
            (p + "mlp.down_proj.weight", (h, i), "w"),
        ]
    out.append(("model.norm.weight", (h,), "norm"))
    if not cfg["tie_word_embeddings"]:
        out.append(("lm_head.weight", (cfg["vocab_size"], h), "w"))
    return out


def to_bf16(x):
    """float32 array -> uint16 bf16 bit patterns, round to nearest even."""
    u = x.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def normal_table(rng, std):
    """65536 seeded N(0, std) draws as bf16 bit patterns (the values the weights take)."""
    return to_bf16(rng.standard_normal(65536, np.float32) * np.float32(std))


CHUNK = 1 << 24  # elements per generated piece


def random_piece(table, seed, tensor_index, start, m):
    """m weights of one piece: table entries picked by SFC64 bits seeded by (seed, tensor, start),
    so a piece's bytes do not depend on the threads or the shards."""
    bits = np.random.SFC64(np.random.SeedSequence([seed, tensor_index, start // CHUNK]))
    idx = bits.random_raw((m + 3) // 4).view(np.uint16)[:m]
    return table[idx]


def write_shard(path, tensors, seed, table, first_index, pool, inflight):
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, _ in tensors:
        n = int(np.prod(shape)) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header).encode()
    text += b" " * ((8 - (8 + len(text)) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        one = to_bf16(np.ones(1, np.float32))[0]
        pending = collections.deque()  # pieces in flight, written in order
        for ti, (name, shape, kind) in enumerate(tensors, start=first_index):
            n = int(np.prod(shape))
            for start in range(0, n, CHUNK):
                m = min(CHUNK, n - start)
                if kind == "norm":
                    pending.append(pool.submit(np.full, m, one, np.uint16))
                else:
                    pending.append(pool.submit(random_piece, table, seed, ti, start, m))
                while len(pending) > inflight:
                    f.write(pending.popleft().result())
        while pending:
            f.write(pending.popleft().result())
    return offset


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--shards", type=int, default=1, help="number of safetensors shards (index when > 1)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="1b", help="1b (Llama-3.2-1B) or 8b (Llama-3-8B)")
    ap.add_argument("--layers", type=int, default=0, help="fewer layers for a quicker check (0 = the preset's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="generator threads (0 = all cores)")
    ap.add_argument("--std", type=float, default=0.02)
    args = ap.parse_args()
    base = PRESETS[args.preset]
    cfg = dict(base, num_hidden_layers=args.layers or base["num_hidden_layers"])
    os.makedirs(args.out_dir, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    table = normal_table(rng, args.std)
    t0 = time.time()
    tensors = tensor_list(cfg)
    total = sum(int(np.prod(s)) for _, s, _ in tensors)
    threads = args.threads or os.cpu_count()
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=threads)
    inflight = 2 * threads
    if args.shards <= 1:
        write_shard(os.path.join(args.out_dir, "model.safetensors"), tensors, args.seed, table, 0, pool, inflight)
    else:
        per = -(-len(tensors) // args.shards)
        weight_map = {}
        for k in range(args.shards):
            part = tensors[k * per:(k + 1) * per]
            name = f"model-{k + 1:05d}-of-{args.shards:05d}.safetensors"
            write_shard(os.path.join(args.out_dir, name), part, args.seed, table, k * per, pool, inflight)
            weight_map.update({t[0]: name for t in part})
        with open(os.path.join(args.out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total * 2}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(args.out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    dt = time.time() - t0
    print(f"wrote {args.out_dir}: {total / 1e9:.3f} B parameters, {total * 2 / 2**30:.2f} GiB bf16 "
          f"in {dt:.1f} s ({total * 2 / 1e9 / max(dt, 1e-9):.2f} GB/s)")


if __name__ == "__main__":
    main()
