#!/usr/bin/env python3
"""Writes a random-initialised model with Llama-3.2-1B's shapes in bf16 (not committed).

Shapes (from Llama-3.2-1B's public config.json): vocab 128256, hidden 2048, intermediate 8192,
16 layers, 32 query heads and 8 KV heads of head_dim 64, tied embeddings, RMSNorm eps 1e-5,
rope_theta 500000 with llama3 rope scaling (factor 32, low 1, high 4, original context 8192).
That is 1.24 B parameters, 2.47 GB in bf16. Weights are N(0, 0.02) (norm weights 1), rounded to
bf16 (nearest even), from a seeded numpy generator, written chunk by chunk so the script needs
little memory. The safetensors files are written directly (numpy has no bf16 dtype): header
JSON padded to 8 bytes, tensors in order. No tokenizer: prompt the model with token ids.

  python3 tools/make_llama_shapes.py /tmp/llama-1b-shapes [--shards 2] [--layers 16]
  build/veloxquant generate --model /tmp/llama-1b-shapes --prompt-ids 128000,791,1401,374 \\
      --max-tokens 8 --ignore-eos        # the summary's last line is the peak RSS
"""
import argparse
import json
import os
import struct

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
    return out


def to_bf16(x):
    """float32 array -> uint16 bf16 bit patterns, round to nearest even."""
    u = x.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def write_shard(path, tensors, rng, std):
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
        chunk = 1 << 24
        for name, shape, kind in tensors:
            n = int(np.prod(shape))
            for start in range(0, n, chunk):
                m = min(chunk, n - start)
                vals = np.ones(m, np.float32) if kind == "norm" else rng.standard_normal(m, np.float32) * std
                f.write(to_bf16(vals).tobytes())
    return offset


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--shards", type=int, default=1, help="number of safetensors shards (index when > 1)")
    ap.add_argument("--layers", type=int, default=16, help="fewer layers for a quicker check")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--std", type=float, default=0.02)
    args = ap.parse_args()
    cfg = dict(CONFIG, num_hidden_layers=args.layers)
    os.makedirs(args.out_dir, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    tensors = tensor_list(cfg)
    total = sum(int(np.prod(s)) for _, s, _ in tensors)
    if args.shards <= 1:
        write_shard(os.path.join(args.out_dir, "model.safetensors"), tensors, rng, args.std)
    else:
        per = -(-len(tensors) // args.shards)
        weight_map = {}
        for k in range(args.shards):
            part = tensors[k * per:(k + 1) * per]
            name = f"model-{k + 1:05d}-of-{args.shards:05d}.safetensors"
            write_shard(os.path.join(args.out_dir, name), part, rng, args.std)
            weight_map.update({t[0]: name for t in part})
        with open(os.path.join(args.out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total * 2}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(args.out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    print(f"wrote {args.out_dir}: {total / 1e9:.3f} B parameters, {total * 2 / 2**30:.2f} GiB bf16")


if __name__ == "__main__":
    main()
