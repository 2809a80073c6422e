#!/usr/bin/env python3
"""Tokenise the corpus into the arrays the training run carries, and write the held-out
evaluation documents.

Input: corpus/docs.jsonl (tools/corpus/extract_corpus.py), the shipped tokenizer.json.
Outputs:
  <cache>/train.u16, <cache>/valid.u16  uint16 token streams: each document is
      [<|bos|>] ids [<|eos|>]; train documents in a seeded random order, valid in id order.
  <cache>/meta.json                     token counts per split and source.
  data/eval/heldout.jsonl               test-split documents with >= --ctx tokens (incl.
      <|bos|>), at most --max-eval docs, chosen by SHA-1 of the id (fixed); one object per
      line {id, source, text, n_tokens}; text is the full document.
  data/eval/heldout_ids.u16             the first --ctx token ids of each of those documents
      (incl. the leading <|bos|>), row-major [n_docs, ctx], little-endian uint16.
Usage: python3 tools/train/prepare_data.py --corpus corpus/docs.jsonl --cache .cache/train
"""

import argparse
import hashlib
import json
import os
import random

import numpy as np
from tokenizers import Tokenizer


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", default="corpus/docs.jsonl")
    ap.add_argument("--tokenizer", default="models/vq-mini-llama/tokenizer.json")
    ap.add_argument("--cache", default=".cache/train")
    ap.add_argument("--eval-dir", default="data/eval")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--max-eval", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()

    tok = Tokenizer.from_file(args.tokenizer)
    bos, eos = tok.token_to_id("<|bos|>"), tok.token_to_id("<|eos|>")
    docs = [json.loads(line) for line in open(args.corpus, encoding="utf-8")]
    encs = tok.encode_batch([d["text"] for d in docs], add_special_tokens=False)
    os.makedirs(args.cache, exist_ok=True)
    os.makedirs(args.eval_dir, exist_ok=True)

    meta = {"tokens": {}, "docs": {}}
    for split in ("train", "valid"):
        idx = [i for i, d in enumerate(docs) if d["split"] == split]
        if split == "train":
            random.Random(args.seed).shuffle(idx)
        parts = []
        for i in idx:
            parts.append(np.array([bos] + encs[i].ids + [eos], dtype=np.uint16))
            src = docs[i]["source"]
            meta["tokens"].setdefault(split, {}).setdefault(src, 0)
            meta["tokens"][split][src] += len(encs[i].ids) + 2
        arr = np.concatenate(parts)
        arr.tofile(os.path.join(args.cache, f"{split}.u16"))
        meta["docs"][split] = len(idx)
        print(f"{split}: {len(idx)} docs, {arr.size} tokens")

    test = [i for i, d in enumerate(docs) if d["split"] == "test" and len(encs[i].ids) + 1 >= args.ctx]
    test.sort(key=lambda i: hashlib.sha1(docs[i]["id"].encode()).hexdigest())
    test = sorted(test[:args.max_eval], key=lambda i: docs[i]["id"])
    ids = np.zeros((len(test), args.ctx), dtype=np.uint16)
    with open(os.path.join(args.eval_dir, "heldout.jsonl"), "w", encoding="utf-8") as f:
        for row, i in enumerate(test):
            full = [bos] + encs[i].ids
            ids[row] = full[:args.ctx]
            f.write(json.dumps({"id": docs[i]["id"], "source": docs[i]["source"],
                                "text": docs[i]["text"], "n_tokens": len(full)},
                               ensure_ascii=False) + "\n")
    ids.astype("<u2").tofile(os.path.join(args.eval_dir, "heldout_ids.u16"))
    meta["eval_docs"] = len(test)
    meta["eval_sources"] = {}
    for i in test:
        meta["eval_sources"][docs[i]["source"]] = meta["eval_sources"].get(docs[i]["source"], 0) + 1
    with open(os.path.join(args.cache, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    print(json.dumps(meta))


if __name__ == "__main__":
    main()
