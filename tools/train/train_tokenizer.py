#!/usr/bin/env python3
"""Train the byte-level BPE tokenizer of the shipped model (HF `tokenizers`).

Input: corpus/docs.jsonl from tools/corpus/extract_corpus.py (train split only).
Output: <out>/tokenizer.json and <out>/tokenizer_config.json.
Design (Qwen2-style): NFC normaliser; a regex pre-tokenizer that splits words (with one
leading non-letter), single digits, punctuation runs and whitespace runs; then byte-level
mapping (no prefix space); BPE with vocab --vocab (8192). Special tokens, ids 0..2:
<|bos|>, <|eos|>, <|pad|>. The post-processor prepends <|bos|> when special tokens are
added, so `encode(text)` gives [0, ...]; a training document is [bos] text [eos].
Usage: python3 tools/train/train_tokenizer.py --corpus corpus/docs.jsonl --out models/vq-mini-llama
"""

import argparse
import json
import os

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

SPECIALS = ["<|bos|>", "<|eos|>", "<|pad|>"]
# Qwen2's pre-tokenizer pattern: contractions, words with one optional leading non-letter,
# single digits, punctuation runs with trailing newlines, newline runs, whitespace runs.
SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def build_tokenizer():
    tok = Tokenizer(models.BPE(byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", 0)])
    return tok


def iter_train_texts(path):
    with open(path, encoding="utf-8") as f:
        for line in f:
            d = json.loads(line)
            if d["split"] == "train":
                yield d["text"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", default="corpus/docs.jsonl")
    ap.add_argument("--out", default="models/vq-mini-llama")
    ap.add_argument("--vocab", type=int, default=8192)
    args = ap.parse_args()
    tok = build_tokenizer()
    trainer = trainers.BpeTrainer(vocab_size=args.vocab, min_frequency=2, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(iter_train_texts(args.corpus), trainer=trainer)
    assert [tok.token_to_id(s) for s in SPECIALS] == [0, 1, 2], "special token ids must be 0,1,2"
    os.makedirs(args.out, exist_ok=True)
    tok.save(os.path.join(args.out, "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "pad_token": "<|pad|>",
        "add_bos_token": True,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
    }
    with open(os.path.join(args.out, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    sample = "The pass key is 58213. Remember it. Ünïcödé 日本 🙂  x"
    enc = tok.encode(sample)
    print("vocab", tok.get_vocab_size(), "sample ids", enc.ids)
    print("sample tokens", enc.tokens)
    assert tok.decode(enc.ids, skip_special_tokens=True) == sample


if __name__ == "__main__":
    main()
