#!/usr/bin/env python3
"""Synthetic passkey-retrieval documents: a number hidden at a chosen depth of filler text,
asked for at the end.

Prompt layout (text; every piece starts with a space so that piece boundaries are
pre-tokenizer boundaries and token-space assembly equals tokenising the whole string):
  INTRO + filler sentences[:k] + NEEDLE(key) + filler sentences[k:] + QUESTION
  NEEDLE   = " The pass key is 58213. Remember it. 58213 is the pass key."
  QUESTION = " What is the pass key? The pass key is"
The expected continuation is " 58213." and a prediction is correct when the greedy
continuation, stripped of leading whitespace, starts with exactly the key's digits followed by
a non-digit (exact match).
Two uses:
  * the fixed evaluation set (CLI below): lengths ~512/1024/1800 tokens (prompt incl. <|bos|>),
    depths 10%..90% (fraction of filler sentences before the needle), 5-digit keys, own seed;
    written as JSONL {id, prompt, answer, length, depth, target_length}.
  * training documents (`TrainingPasskeys`, used by tools/train/train.py): token-space
    assembly, lengths spread up to the full context, keys of 3-7 digits, filler either the
    classic sentences or a random slice of the training token stream.
The evaluation set is 162 prompts of EVAL_SEED (6 per cell) followed by 54 of EXTEND_SEED
(2 per cell): 216, ids 0..215.
Usage: python3 tools/corpus/passkey.py --tokenizer models/vq-mini-llama/tokenizer.json \
         --out data/eval/passkey.jsonl
"""

import argparse
import json
import random

import numpy as np

INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text."
         " Find it and memorize it. I will quiz you about it.")
FILLER = [" The grass is green.", " The sky is blue.", " The sun is yellow.", " Here we go.",
          " There and back again."]
EXTRA_FILLER = [" The river runs to the sea.", " A bird sings in the tree.",
                " The road is long and dry.", " Snow falls on the hill.",
                " The lamp is on the table.", " Time passes slowly here.",
                " The wind moves the leaves.", " A dog sleeps by the door."]


def needle(key):
    return f" The pass key is {key}. Remember it. {key} is the pass key."


QUESTION = " What is the pass key? The pass key is"
EVAL_LENGTHS = (512, 1024, 1800)
EVAL_DEPTHS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
EVAL_SEED = 20240511
# The set's second part (issue 16: at least 200 prompts, one prompt at most half a point): the
# same 3 lengths x 9 depths, EXTEND_PER_CELL more keys per cell from their own seed, appended
# after the first 162 prompts (which stay byte for byte what EVAL_SEED gives).
EXTEND_SEED = 20261202
EXTEND_PER_CELL = 2
PROBE_SEED = 777  # training-time probe, distinct from the evaluation seed


class Pieces:
    """Token ids of the fixed text pieces (without <|bos|>), from the shipped tokenizer."""

    def __init__(self, tokenizer):
        enc = lambda s: tokenizer.encode(s, add_special_tokens=False).ids
        self.bos = tokenizer.token_to_id("<|bos|>")
        self.eos = tokenizer.token_to_id("<|eos|>")
        self.intro = enc(INTRO)
        self.filler = [enc(s) for s in FILLER]
        self.extra = [enc(s) for s in EXTRA_FILLER]
        self.question = enc(QUESTION)
        self.digits = [enc(str(d)) for d in range(10)]
        self.space = enc(" ")
        self.enc = enc
        for d in self.digits:
            assert len(d) == 1, "digits must be single tokens"
        assert enc(" 12") == self.space + self.digits[1] + self.digits[2]

    def needle_ids(self, key):
        return self.enc(needle(key))

    def answer_ids(self, key):
        """Expected continuation tokens: ' ' then one token per digit."""
        return self.space + [self.digits[int(c)][0] for c in key]


def build_prompt(pieces, target_len, depth, key):
    """Classic-filler prompt of at most target_len tokens (incl. <|bos|>).
    Returns (text, token ids incl. bos)."""
    fixed = 1 + len(pieces.intro) + len(pieces.needle_ids(key)) + len(pieces.question)
    n, total = 0, fixed  # n: number of filler sentences that fit
    while total + len(pieces.filler[n % len(FILLER)]) <= target_len:
        total += len(pieces.filler[n % len(FILLER)])
        n += 1
    k = int(round(depth * n))
    before = "".join(FILLER[i % len(FILLER)] for i in range(k))
    after = "".join(FILLER[i % len(FILLER)] for i in range(k, n))
    text = INTRO + before + needle(key) + after + QUESTION
    ids = [pieces.bos] + pieces.intro
    for i in range(k):
        ids += pieces.filler[i % len(FILLER)]
    ids += pieces.needle_ids(key)
    for i in range(k, n):
        ids += pieces.filler[i % len(FILLER)]
    ids += pieces.question
    return text, ids


def eval_set(tokenizer, seed=EVAL_SEED, per_cell=6, lengths=EVAL_LENGTHS, depths=EVAL_DEPTHS,
             check=True):
    pieces = Pieces(tokenizer)
    rng = random.Random(seed)
    rows = []
    for L in lengths:
        for depth in depths:
            for _ in range(per_cell):
                key = str(rng.randint(10000, 99999))
                text, ids = build_prompt(pieces, L, depth, key)
                if check:
                    whole = tokenizer.encode(text).ids
                    assert whole == ids, "token-space assembly differs from tokenising the text"
                rows.append({"id": len(rows), "prompt": text, "answer": key, "length": len(ids),
                             "depth": depth, "target_length": L, "ids": ids})
    return rows


def is_correct(continuation_text, key):
    """Exact match: leading digits of the stripped continuation equal the key."""
    s = continuation_text.lstrip()
    digits = ""
    for c in s:
        if c.isdigit():
            digits += c
        else:
            break
    return digits == key


class TrainingPasskeys:
    """Token-space passkey training documents ([bos] ... question ' ' digits '.' [eos])."""

    def __init__(self, tokenizer, seed, max_len=2048):
        self.p = Pieces(tokenizer)
        self.rng = np.random.default_rng(seed)
        self.max_len = max_len
        self.period = self.p.enc(".")

    def sample(self, stream):
        """One document as a list of token ids. `stream` is the uint16 training stream used
        as filler for about half of the documents."""
        rng, p = self.rng, self.p
        ndig = 5 if rng.random() < 0.6 else int(rng.integers(3, 8))
        key = str(int(rng.integers(10 ** (ndig - 1), 10 ** ndig)))
        target = int(rng.integers(96, self.max_len + 1))
        head = [p.bos] + (p.intro if rng.random() < 0.7 else [])
        tail = p.question + p.answer_ids(key) + self.period + [p.eos]
        ndl = p.needle_ids(key)
        budget = target - len(head) - len(ndl) - len(tail)
        budget = max(budget, 0)
        depth = rng.random()
        mode = rng.random()
        if mode < 0.5:  # classic / extended sentence filler
            pool = p.filler if rng.random() < 0.6 else p.filler + p.extra
            filler = []
            i = int(rng.integers(0, len(pool)))
            ordered = rng.random() < 0.5
            while True:
                s = pool[i % len(pool)] if ordered else pool[int(rng.integers(0, len(pool)))]
                if len(filler) + len(s) > budget:
                    break
                filler.append(s)
                i += 1
            k = int(round(depth * len(filler)))
            before = [t for s in filler[:k] for t in s]
            after = [t for s in filler[k:] for t in s]
        else:  # slice of real text, special tokens removed
            start = int(rng.integers(0, len(stream) - budget - 1))
            window = stream[start:start + budget]
            window = window[window > 2].tolist()
            k = int(round(depth * len(window)))
            before, after = window[:k], window[k:]
        return head + before + ndl + after + tail


def main():
    from tokenizers import Tokenizer

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", default="models/vq-mini-llama/tokenizer.json")
    ap.add_argument("--out", default="data/eval/passkey.jsonl")
    ap.add_argument("--seed", type=int, default=EVAL_SEED)
    ap.add_argument("--per-cell", type=int, default=6, help="prompts per (length, depth) cell")
    ap.add_argument("--extend-seed", type=int, default=EXTEND_SEED,
                    help="seed of the appended part (0 = none)")
    ap.add_argument("--extend-per-cell", type=int, default=EXTEND_PER_CELL,
                    help="prompts per (length, depth) cell of the appended part")
    args = ap.parse_args()
    tok = Tokenizer.from_file(args.tokenizer)
    rows = eval_set(tok, seed=args.seed, per_cell=args.per_cell)
    if args.extend_seed and args.extend_per_cell > 0:
        for r in eval_set(tok, seed=args.extend_seed, per_cell=args.extend_per_cell):
            r["id"] = len(rows)
            rows.append(r)
    with open(args.out, "w", encoding="utf-8") as f:
        for r in rows:
            r = {k: v for k, v in r.items() if k != "ids"}
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    by_len = {}
    for r in rows:
        by_len.setdefault(r["target_length"], []).append(r["length"])
    print(f"wrote {len(rows)} prompts to {args.out}; lengths (min..max tokens incl. bos): "
          + ", ".join(f"{k}: {min(v)}..{max(v)}" for k, v in by_len.items()))


if __name__ == "__main__":
    main()
