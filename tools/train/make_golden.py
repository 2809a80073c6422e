#!/usr/bin/env python3
"""Golden reference data for the C++ runtime, from transformers in fp32 (CPU, or GPU with TF32 off).

For four prompts (~20, ~300 and ~1500 tokens of text, and a ~1500-token passkey prompt):
  * token ids from the shipped tokenizer (tokenizer.json, with the leading <|bos|>);
  * fp32 logits of the last 8 prompt positions (positions n-8 .. n-1), computed by
    LlamaForCausalLM with the shipped bf16 weights upcast to fp32, eager attention;
  * the greedy 32-token continuation (argmax, lowest id on ties, no stop on <|eos|>),
    each step recomputed over the whole sequence without a cache; the same continuation
    from a KV-cached decode is checked to agree (cached_greedy_agrees).
Output (<out>/): golden.json (prompts, ids, continuation ids/text, layout) and logits.f32
  (little-endian float32, row-major [n_prompts, 8, vocab], prompt order of golden.json).
Usage: python3 tools/train/make_golden.py --model models/vq-mini-llama --out tests/data/golden
"""

import argparse
import json
import os
import sys

import numpy as np
import torch
from tokenizers import Tokenizer
from transformers import LlamaForCausalLM

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tools", "corpus"))
import passkey  # noqa: E402

N_LAST = 8
N_GEN = 32
SHORT = "The pass key is a number that you must remember. In the beginning God created"


def cut_to_tokens(tok, text, target):
    """Longest prefix ending before a space or newline whose encoding has <= target tokens."""
    lo, hi = 0, len(text)
    best = text[:0]
    while lo <= hi:
        mid = (lo + hi) // 2
        cut = text[:mid]
        j = max(cut.rfind(" "), cut.rfind("\n"))
        cut = cut[:j] if j > 0 else cut
        if len(tok.encode(cut).ids) <= target:
            best, lo = cut, mid + 1
        else:
            hi = mid - 1
    return best


def make_prompts(tok, eval_dir):
    docs = [json.loads(l) for l in open(os.path.join(eval_dir, "heldout.jsonl"), encoding="utf-8")]
    first = {}
    for d in docs:
        first.setdefault(d["source"], d)
    med_doc = first.get("bible", docs[0])
    long_doc = first.get("foldoc", docs[-1])
    _, pk_ids = passkey.build_prompt(passkey.Pieces(tok), 1500, 0.37, "40721")
    pk_text = tok.decode(pk_ids, skip_special_tokens=True)
    return [
        {"name": "short", "source": "fixed sentence", "text": SHORT},
        {"name": "medium", "source": "data/eval/heldout.jsonl " + med_doc["id"],
         "text": cut_to_tokens(tok, med_doc["text"], 300)},
        {"name": "long", "source": "data/eval/heldout.jsonl " + long_doc["id"],
         "text": cut_to_tokens(tok, long_doc["text"], 1500)},
        {"name": "passkey", "source": "tools/corpus/passkey.py build_prompt(1500, 0.37, '40721')",
         "text": pk_text, "answer": "40721"},
    ]


def greedy_cached(model, x, n):
    """Greedy decode with the KV cache (prefill, then one token per step), no stop at eos."""
    out = model(input_ids=x, use_cache=True)
    past, gen = out.past_key_values, []
    for _ in range(n):
        nxt = int(out.logits[0, -1].argmax())
        gen.append(nxt)
        out = model(input_ids=torch.tensor([[nxt]], device=x.device), past_key_values=past,
                    use_cache=True)
        past = out.past_key_values
    return gen


@torch.no_grad()
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.join(REPO, "models/vq-mini-llama"))
    ap.add_argument("--eval-dir", default=os.path.join(REPO, "data/eval"))
    ap.add_argument("--out", default=os.path.join(REPO, "tests/data/golden"))
    ap.add_argument("--device", default="cpu", help="cpu or cuda (fp32 either way, TF32 off)")
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    dev = torch.device(args.device)
    tok = Tokenizer.from_file(os.path.join(args.model, "tokenizer.json"))
    model = LlamaForCausalLM.from_pretrained(args.model, dtype=torch.float32,
                                             attn_implementation="eager").to(dev).eval()
    prompts = make_prompts(tok, args.eval_dir)
    os.makedirs(args.out, exist_ok=True)
    all_logits = []
    for p in prompts:
        ids = tok.encode(p["text"]).ids
        x = torch.tensor([ids], device=dev)
        logits = model(input_ids=x, use_cache=False).logits[0].float().cpu()
        all_logits.append(logits[-N_LAST:].numpy().astype("<f4"))
        seq, gen = list(ids), []
        for _ in range(N_GEN):
            nxt = int(model(input_ids=torch.tensor([seq], device=dev), use_cache=False).logits[0, -1].argmax())
            gen.append(nxt)
            seq.append(nxt)
        cached = greedy_cached(model, x, N_GEN)
        top = logits[-1].topk(5)
        p.update({"n_tokens": len(ids), "ids": ids, "greedy_ids": gen,
                  "greedy_text": tok.decode(gen, skip_special_tokens=False),
                  "cached_greedy_agrees": cached == gen,
                  "last_top5_ids": top.indices.tolist(),
                  "last_top5_logits": [float(v) for v in top.values]})
        print(f"{p['name']}: {len(ids)} tokens, continuation {p['greedy_text']!r}, "
              f"cached agrees {cached == gen}")
    arr = np.stack(all_logits)
    arr.tofile(os.path.join(args.out, "logits.f32"))
    cfg = json.load(open(os.path.join(args.model, "config.json")))
    meta = {
        "model": "models/vq-mini-llama (bf16 weights upcast to fp32)",
        "reference": f"transformers LlamaForCausalLM, fp32 (TF32 off), eager attention, "
                     f"device {args.device}, torch {torch.__version__}",
        "logits_file": "logits.f32",
        "logits_layout": "little-endian float32, row-major [n_prompts, n_last, vocab]; row i of "
                         "prompt p holds the logits at prompt position n_tokens - n_last + i",
        "n_last": N_LAST, "vocab": cfg["vocab_size"], "n_gen": N_GEN,
        "greedy": "argmax over fp32 logits, no stop at <|eos|>, recomputed without a cache",
        "prompts": prompts,
    }
    with open(os.path.join(args.out, "golden.json"), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print("wrote", args.out, arr.shape)


if __name__ == "__main__":
    main()
