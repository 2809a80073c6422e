#!/usr/bin/env python3
"""Converts a Hugging Face Llama checkpoint (our shipped model) to GGUF with the `gguf` package.

llama.cpp's own converter (convert_hf_to_gguf.py) imports torch, which this machine does not
have; the `gguf` package (pure Python + numpy, shipped inside llama.cpp as gguf-py) writes the
same file format. What this script does, for model_type "llama" only:
  - metadata: llama.* hyper-parameters from config.json (context, widths, heads, rope base,
    RMSNorm eps), general.file_type = MOSTLY_BF16 (or F16 with --f16);
  - tokenizer: tokenizer.ggml.model "gpt2" (byte-level BPE), the vocabulary in id order, the
    merges, token types (added special tokens are CONTROL), BOS/EOS ids from config.json,
    pre-tokenizer "qwen2" (its split pattern also isolates single digits, like ours);
  - tensors renamed to llama.cpp's (token_embd, blk.N.attn_q, ..., output_norm); 2-D weights
    kept in bf16 (or converted to f16), 1-D norms in f32; q and k rows permuted from Hugging
    Face's half-split RoPE layout to llama.cpp's interleaved one (the same permutation
    convert_hf_to_gguf.py applies: reshape(heads, 2, head_dim / 2, hidden).swapaxes(1, 2)).
  - tied embeddings: no output.weight (llama.cpp then reads token_embd).

  python3 tools/llama_cpp/hf_to_gguf.py models/vq-mini-llama /tmp/vq-mini-llama.gguf \\
      --gguf-py /path/to/llama.cpp/gguf-py
"""
import argparse
import json
import os
import struct
import sys

import numpy as np


def read_safetensors(model_dir):
    """name -> (dtype string, shape, raw bytes) for every tensor (single file or index)."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    files = sorted(set(json.load(open(index))["weight_map"].values())) if os.path.exists(index) \
        else ["model.safetensors"]
    out = {}
    for name in files:
        with open(os.path.join(model_dir, name), "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
            base = 8 + n
            for key, info in header.items():
                if key == "__metadata__":
                    continue
                b, e = info["data_offsets"]
                f.seek(base + b)
                out[key] = (info["dtype"], info["shape"], f.read(e - b))
    return out


def as_f32(dtype, shape, raw):
    if dtype == "F32":
        return np.frombuffer(raw, np.float32).reshape(shape)
    if dtype == "F16":
        return np.frombuffer(raw, np.float16).astype(np.float32).reshape(shape)
    if dtype == "BF16":
        return (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
    raise ValueError(f"unsupported dtype {dtype}")


def as_bf16_bits(dtype, shape, raw):
    if dtype == "BF16":
        return np.frombuffer(raw, np.uint16).reshape(shape)
    u = as_f32(dtype, shape, raw).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def permute_rope(w, n_head):
    """Hugging Face half-split rows -> llama.cpp interleaved rows (per head)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir")
    ap.add_argument("out")
    ap.add_argument("--gguf-py", help="llama.cpp's gguf-py folder (else the installed gguf package)")
    ap.add_argument("--f16", action="store_true", help="write 2-D weights as f16 instead of bf16")
    args = ap.parse_args()
    if args.gguf_py:
        sys.path.insert(0, args.gguf_py)
    import gguf  # noqa: E402

    cfg = json.load(open(os.path.join(args.model_dir, "config.json")))
    if cfg.get("model_type") != "llama":
        raise SystemExit(f"only model_type llama is handled, got {cfg.get('model_type')}")
    tok = json.load(open(os.path.join(args.model_dir, "tokenizer.json")))
    n_head, n_kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_head
    rope = cfg.get("rope_parameters") or {}
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))

    w = gguf.GGUFWriter(args.out, "llama")
    w.add_name(os.path.basename(os.path.normpath(args.model_dir)))
    w.add_context_length(cfg.get("max_position_embeddings", 2048))
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(theta))
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if args.f16 else gguf.LlamaFileType.MOSTLY_BF16)

    vocab = tok["model"]["vocab"]
    tokens = [None] * cfg["vocab_size"]
    for s, i in vocab.items():
        tokens[i] = s
    special = {a["id"] for a in tok.get("added_tokens", []) if a.get("special")}
    for a in tok.get("added_tokens", []):
        tokens[a["id"]] = a["content"]
    for i, t in enumerate(tokens):
        if t is None:
            tokens[i] = f"[PAD{i}]"
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
                       for i in range(len(tokens))])
    w.add_token_merges(merges)
    if cfg.get("bos_token_id") is not None:
        w.add_bos_token_id(cfg["bos_token_id"])
    eos = cfg.get("eos_token_id")
    if eos is not None:
        w.add_eos_token_id(eos[0] if isinstance(eos, list) else eos)
    w.add_add_bos_token(True)

    st = read_safetensors(args.model_dir)

    def put2d(name, key, permute_heads=0):
        dtype, shape, raw = st[key]
        bits = as_bf16_bits(dtype, shape, raw)
        if permute_heads:
            bits = permute_rope(bits, permute_heads)
        bits = np.ascontiguousarray(bits)
        if args.f16:
            f = (bits.astype(np.uint32) << 16).view(np.float32)
            w.add_tensor(name, f.astype(np.float16))
        else:
            w.add_tensor(name, bits.view(np.uint8), raw_dtype=gguf.GGMLQuantizationType.BF16)

    def put1d(name, key):
        w.add_tensor(name, np.ascontiguousarray(as_f32(*st[key]).astype(np.float32)))

    put2d("token_embd.weight", "model.embed_tokens.weight")
    put1d("output_norm.weight", "model.norm.weight")
    if not cfg.get("tie_word_embeddings", False):
        put2d("output.weight", "lm_head.weight")
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        put1d(f"blk.{i}.attn_norm.weight", p + "input_layernorm.weight")
        put2d(f"blk.{i}.attn_q.weight", p + "self_attn.q_proj.weight", n_head)
        put2d(f"blk.{i}.attn_k.weight", p + "self_attn.k_proj.weight", n_kv)
        put2d(f"blk.{i}.attn_v.weight", p + "self_attn.v_proj.weight")
        put2d(f"blk.{i}.attn_output.weight", p + "self_attn.o_proj.weight")
        put1d(f"blk.{i}.ffn_norm.weight", p + "post_attention_layernorm.weight")
        put2d(f"blk.{i}.ffn_gate.weight", p + "mlp.gate_proj.weight")
        put2d(f"blk.{i}.ffn_up.weight", p + "mlp.up_proj.weight")
        put2d(f"blk.{i}.ffn_down.weight", p + "mlp.down_proj.weight")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
