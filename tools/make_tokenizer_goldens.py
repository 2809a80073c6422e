#!/usr/bin/env python3
"""Train the small test tokenizers and write tokenizer goldens with Hugging Face `tokenizers`.

What it does (deterministic, re-runnable; needs only `pip install tokenizers`):
  1. Builds a ~400 KB training text from Debian's `fortunes` files (/usr/share/games/fortunes).
  2. Trains two small BPE tokenizers (vocab ~1000) and saves them under tests/data/tokenizers/:
       sp_bpe.json  SentencePiece-style BPE (Llama-2/Mistral as `tokenizers` serialises it):
                    <unk>/<s>/</s>, 256 <0xNN> byte-fallback tokens, fuse_unk, normalizer
                    Sequence[Prepend("▁"), Replace(" ", "▁")], no pre-tokenizer, decoder
                    Sequence[Replace, ByteFallback, Fuse, Strip], TemplateProcessing "<s> $A".
       bl_bpe.json  byte-level BPE: Sequence[Split(Llama-3 regex, Isolated), Digits(individual),
                    ByteLevel(no regex)], ByteLevel decoder, ignore_merges, Llama-3 style
                    special tokens and a BOS TemplateProcessing.
       wp_bpe.json  the rarer options: unk (no byte fallback), "##" continuing_subword_prefix,
                    "</w>" end_of_word_suffix, NFD + Strip, Whitespace, BPEDecoder, Bert processor.
     plus variants that reuse a trained vocabulary with another pipeline (cheap extra coverage):
       sp_meta.json   Metaspace pre-tokenizer (prepend_scheme "first", split) + Metaspace decoder,
                      merges serialised as [a, b] pairs.
       bl_qwen2.json  Qwen2 split regex (single digits), no Digits step, merges as pairs.
       bl_gpt2.json   ByteLevel pre-tokenizer with its own GPT-2 regex and add_prefix_space.
       bl_splits.json every Split behaviour (and invert, a String pattern), grouped Digits,
                      CharDelimiterSplit, an NFC normalizer.
       wp_fused.json  wp_bpe with fused unks, WhitespaceSplit, Regex Replace, Roberta processor.
  3. For every tokenizer above, and for models/*/tokenizer.json when present (the shipped model,
     trained elsewhere; absent is fine), encodes a fixed, varied text set and writes
     tests/data/tokenizers/goldens_<name>.json:
       {"tokenizer_file": <path relative to repo root>, "tokenizer_fnv1a64": <hash of that file>,
        "cases": [{"text", "ids" (no specials), "ids_special" (add_special_tokens=True),
                   "decoded" (decode(ids); omitted when equal to text: the round trip holds),
                   "decoded_skip" (decode(ids_special, skip specials); omitted when equal to
                   decoded)}]}
Usage: python3 tools/make_tokenizer_goldens.py [--repo ROOT]
"""

import argparse
import glob
import json
import os
import random

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import trainers, AddedToken

LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
STRING_MERGES = {"sp_bpe", "bl_gpt2"}  # saved with merges as "a b"; the others as [a, b]
FORTUNE_DIR = "/usr/share/games/fortunes"
CORPUS_BYTES = 400_000


def corpus_lines():
    """Fortune cookies as plain text lines, about CORPUS_BYTES in a fixed order."""
    files = sorted(
        f
        for f in glob.glob(os.path.join(FORTUNE_DIR, "*"))
        if not f.endswith((".dat", ".u8")) and os.path.isfile(f)
    )
    if not files:
        raise SystemExit(f"no fortune files in {FORTUNE_DIR}: apt-get install fortunes")
    lines, total = [], 0
    # Round-robin over files so every topic contributes.
    contents = []
    for f in files:
        with open(f, "rb") as fh:
            text = fh.read().decode("utf-8", errors="ignore")
        # Drop overstriking (x\bx) and the "%" separators.
        text = text.replace("\b", "")
        contents.append([ln for ln in text.splitlines() if ln.strip() and ln.strip() != "%"])
    idx = 0
    while total < CORPUS_BYTES and any(contents):
        src = contents[idx % len(contents)]
        idx += 1
        if not src:
            continue
        chunk = src[:40]
        del src[:40]
        for ln in chunk:
            lines.append(ln)
            total += len(ln.encode("utf-8")) + 1
    return lines


def train_sp_bpe(lines):
    """SentencePiece-style BPE with byte fallback, saved in the Llama-2 (legacy) layout."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    # Train on "▁word" pieces like SentencePiece does; the saved pipeline then uses the
    # Llama-2 normalizer form (no pre-tokenizer: the whole text is one BPE word).
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.BpeTrainer(
        vocab_size=1000 - 256,
        special_tokens=["<unk>", "<s>", "</s>"],
        limit_alphabet=120,
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer)
    data = json.loads(tok.to_str())
    # Insert the 256 byte tokens right after the 3 specials (ids 3..258), as Llama-2 has them.
    old_vocab = sorted(data["model"]["vocab"].items(), key=lambda kv: kv[1])
    vocab = {}
    for piece, _ in old_vocab[:3]:
        vocab[piece] = len(vocab)
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece, _ in old_vocab[3:]:
        if piece not in vocab:
            vocab[piece] = len(vocab)
    data["model"]["vocab"] = vocab
    data["normalizer"] = {
        "type": "Sequence",
        "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
        ],
    }
    data["pre_tokenizer"] = None
    tok = Tokenizer.from_str(json.dumps(data))
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A </s> <s> $B", special_tokens=[("<s>", 1), ("</s>", 2)]
    )
    # A normalized added token: matched against the normalized text (its pattern is "▁[note]").
    tok.add_tokens([AddedToken("[note]", normalized=True, special=False)])
    return tok


def train_bl_bpe(lines):
    """Byte-level BPE with the Llama-3 split regex and individual digits."""
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(LLAMA3_PATTERN_REGEX(), behavior="isolated", invert=False),
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=1000,
        special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer)
    tok.decoder = decoders.ByteLevel()
    # Extra added tokens exercising the flags: rstrip/lstrip special, a normalized non-special.
    tok.add_special_tokens([AddedToken("<|eot_id|>", rstrip=True, normalized=False)])
    tok.add_special_tokens([AddedToken("<mask>", lstrip=True, normalized=False)])
    tok.add_tokens([AddedToken("[note]", normalized=True, special=False)])
    tok.add_tokens([AddedToken("@@", single_word=True, normalized=False, special=False)])
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single="<|begin_of_text|> $A",
                pair="<|begin_of_text|> $A <|begin_of_text|> $B",
                special_tokens=[("<|begin_of_text|>", bos)],
            ),
        ]
    )
    return tok


def train_wp_bpe(lines):
    """The rarer BPE options: unk without byte fallback (unfused), continuing_subword_prefix
    "##", end_of_word_suffix "</w>", NFD + Strip normalizers, Whitespace pre-tokenizer,
    BPEDecoder and BertProcessing ([CLS] $A [SEP])."""
    tok = Tokenizer(
        models.BPE(
            unk_token="[UNK]", continuing_subword_prefix="##", end_of_word_suffix="</w>"
        )
    )
    tok.normalizer = normalizers.Sequence([normalizers.NFD(), normalizers.Strip()])
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["[UNK]", "[CLS]", "[SEP]"],
        limit_alphabet=70,
        continuing_subword_prefix="##",
        end_of_word_suffix="</w>",
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer)
    tok.decoder = decoders.BPEDecoder(suffix="</w>")
    tok.post_processor = processors.BertProcessing(
        ("[SEP]", tok.token_to_id("[SEP]")), ("[CLS]", tok.token_to_id("[CLS]"))
    )
    return tok


def LLAMA3_PATTERN_REGEX():
    from tokenizers import Regex

    return Regex(LLAMA3_PATTERN)


def variant(tok, edit):
    """A copy of tok with its JSON edited by edit(data)."""
    data = json.loads(tok.to_str())
    edit(data)
    return Tokenizer.from_str(json.dumps(data))


def merges_as_pairs(data):
    data["model"]["merges"] = [
        m.split(" ") if isinstance(m, str) else m for m in data["model"]["merges"]
    ]


def merges_as_strings(data):
    data["model"]["merges"] = [" ".join(m) if isinstance(m, list) else m for m in data["model"]["merges"]]


def sp_meta_edit(data):
    data["normalizer"] = None
    data["pre_tokenizer"] = {
        "type": "Metaspace",
        "replacement": "▁",
        "prepend_scheme": "first",
        "split": True,
    }
    data["decoder"] = {
        "type": "Sequence",
        "decoders": [
            {"type": "ByteFallback"},
            {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": True},
        ],
    }
    merges_as_pairs(data)


def bl_qwen2_edit(data):
    data["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [
            {
                "type": "Split",
                "pattern": {"Regex": QWEN2_PATTERN},
                "behavior": "Isolated",
                "invert": False,
            },
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        ],
    }
    data["model"]["ignore_merges"] = False
    merges_as_pairs(data)


def wp_fused_edit(data):
    """wp_bpe with fused unks, WhitespaceSplit, a Regex Replace and RobertaProcessing."""
    data["model"]["fuse_unk"] = True
    data["normalizer"] = {
        "type": "Sequence",
        "normalizers": [
            {"type": "NFD"},
            {"type": "Replace", "pattern": {"Regex": "[0-9]{4,}"}, "content": "NUM"},
            {"type": "Strip", "strip_left": True, "strip_right": False},
        ],
    }
    data["pre_tokenizer"] = {"type": "WhitespaceSplit"}
    data["post_processor"] = {
        "type": "RobertaProcessing",
        "sep": ["[SEP]", data["model"]["vocab"]["[SEP]"]],
        "cls": ["[CLS]", data["model"]["vocab"]["[CLS]"]],
        "trim_offsets": True,
        "add_prefix_space": False,
    }


def bl_splits_edit(data):
    """Byte-level vocab with every Split behaviour, invert, a String pattern, grouped Digits,
    CharDelimiterSplit and a ByteLevel normalizer placed after NFC."""
    data["normalizer"] = {"type": "Sequence", "normalizers": [{"type": "NFC"}]}
    data["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "CharDelimiterSplit", "delimiter": "|"},
            {"type": "Split", "pattern": {"String": "--"}, "behavior": "Removed", "invert": False},
            {"type": "Split", "pattern": {"Regex": "[,.;:!?]+"}, "behavior": "MergedWithPrevious",
             "invert": False},
            {"type": "Split", "pattern": {"Regex": "\\s"}, "behavior": "MergedWithNext",
             "invert": False},
            {"type": "Split", "pattern": {"Regex": "\\p{Lu}"}, "behavior": "Contiguous",
             "invert": False},
            {"type": "Split", "pattern": {"Regex": "[aeiou]+"}, "behavior": "Isolated",
             "invert": True},
            {"type": "Digits", "individual_digits": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
             "use_regex": False},
        ],
    }
    data["model"]["ignore_merges"] = False


def bl_gpt2_edit(data):  # noqa: D103 (merges saved as strings, see STRING_MERGES)
    data["pre_tokenizer"] = {
        "type": "ByteLevel",
        "add_prefix_space": True,
        "trim_offsets": True,
        "use_regex": True,
    }
    data["post_processor"] = {
        "type": "ByteLevel",
        "add_prefix_space": True,
        "trim_offsets": True,
        "use_regex": True,
    }
    data["model"]["ignore_merges"] = False


def text_set(special_tokens):
    """Fixed, varied texts plus seeded random mixtures."""
    texts = [
        "",
        "Hello world",
        "Hello, world! How are you today?",
        " leading space",
        "trailing space ",
        "   ",
        " ",
        "a",
        "The quick brown fox jumps over the lazy dog.",
        "I'm sure you'll see they've done it; she'd say I'D and WE'LL and it's DON'T.",
        "café naïve résumé façade Ångström über crème brûlée",
        "cafe\u0301 (combining acute, not NFC) and cafe\u0301\u0327",
        "Ça va? ¿Qué tal? Grüß Gott! Œuvre, æsir, ß, ﬁ ligature",
        "中文测试：你好，世界！",
        "日本語のテキストとカタカナ、ひらがな。",
        "한국어 텍스트입니다",
        "Привет, мир! Ελληνικά γράμματα.",
        "مرحبا بالعالم",
        "שלום עולם",
        "हिन्दी पाठ परीक्षण",
        "emoji: 😀 👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ 🦀",
        "🎉🎉🎉",
        "digits 0123456789 and 3.14159 and 1,000,000 and 2024-01-31",
        "12345678901234567890",
        "x1y22z333w4444",
        "١٢٣ ٤٥٦ (Arabic-Indic digits) ² ½ Ⅻ",
        "tabs\tand\t\ttabs",
        "line one\nline two\n\nline four\r\nwindows line\r\n",
        "multiple     spaces   between      words",
        "\n\n\n",
        "  \t \n  mixed whitespace  \t\n",
        "trailing newline\n",
        "pneumonoultramicroscopicsilicovolcanoconiosis",
        "a" * 300,
        "ab" * 150 + " " + "xyz" * 80,
        "supercalifragilisticexpialidocious" * 4,
        "def f(x):\n    return x ** 2  # square\n",
        "int main() { printf(\"%d\\n\", 42); return 0; }",
        "https://example.com/path?query=1&b=2#frag",
        "user@example.org, @handle, #hashtag, $100, 50%, a+b=c, x^2, ~/dir",
        "ASCII punctuation: !\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~",
        "math: ∀x∈ℝ, ∑ᵢ xᵢ² ≤ ∞ → ∫ f(x) dx ≈ π",
        "zero\u200bwidth\u200djoiner\ufeffbom",
        "replacement char \ufffd literal",
        "nul\x00byte and bell\x07 and del\x7f",
        "<0x41> looks like a byte token",
        "▁ metaspace char literally ▁▁",
        "Ġ and Ċ are byte-level symbols",
        "<s",
        "s>",
        "[note] lowercase note, [NOTE] upper",
        "Some text [note]with a note",
        "x @@ y, x@@y, @@, @@x, é@@, (@@)",
        "a|b||c | d -- e--f, g. H;;I!? JKL mnOP aeiou xyz 2024 123456 7",
        "Ça VA, Bien--Merci!! 42|| ÉTÉ",
        "It was the best of times, it was the worst of times, it was the age of wisdom, "
        "it was the age of foolishness, it was the epoch of belief.",
    ]
    for sp in special_tokens:
        texts.append(f"{sp}Hello{sp}")
        texts.append(f"before {sp} after")
        texts.append(f"  {sp}  spaced  {sp}  ")
        texts.append(f"{sp}")
        texts.append(f"{sp}{sp}")
        texts.append(f"x{sp}\n")
    rng = random.Random(1234)
    pools = [
        "abcdefghijklmnopqrstuvwxyz",
        "ABCDEFGHIJKLMNOPQRSTUVWXYZ",
        "0123456789",
        " " * 6 + "\t\n",
        ".,;:!?'\"-()[]{}",
        "éèêëàâäôöûüçñÉÀ",
        "中文日本語한국",
        "😀👍🏽🦀❤️🇫🇷",
        "'s 're 've ll d",
    ]
    for _ in range(40):
        n = rng.randint(1, 60)
        s = "".join(rng.choice(rng.choice(pools)) for _ in range(n))
        texts.append(s)
    return texts


def fnv1a64(data):
    """FNV-1a 64 of bytes: the goldens record it so a changed tokenizer.json is detected."""
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def write_goldens(tok, name, tok_rel, out_dir):
    added = tok.get_added_tokens_decoder()
    specials = [t.content for _, t in sorted(added.items())]
    cases = []
    for text in text_set(specials):
        ids = tok.encode(text, add_special_tokens=False).ids
        ids_special = tok.encode(text, add_special_tokens=True).ids
        decoded = tok.decode(ids, skip_special_tokens=False)
        decoded_skip = tok.decode(ids_special, skip_special_tokens=True)
        case = {"text": text, "ids": ids, "ids_special": ids_special}
        # Omitted when equal, to keep the files small: decoded == text (the round trip holds),
        # decoded_skip == decoded.
        if decoded != text:
            case["decoded"] = decoded
        if decoded_skip != decoded:
            case["decoded_skip"] = decoded_skip
        cases.append(case)
    path = os.path.join(out_dir, f"goldens_{name}.json")
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(
            {
                "generator": "tools/make_tokenizer_goldens.py",
                "tokenizers_version": __import__("tokenizers").__version__,
                "tokenizer_file": tok_rel,
                "tokenizer_fnv1a64": fnv1a64(open(os.path.join(out_dir, "..", "..", "..", tok_rel), "rb").read()),
                "cases": cases,
            },
            fh,
            ensure_ascii=False,
            separators=(",", ":"),
        )
        fh.write("\n")
    n_round = sum("decoded" not in c for c in cases)
    print(f"{path}: {len(cases)} cases ({n_round} round-trip), {os.path.getsize(path)} bytes")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repo", default=os.path.join(os.path.dirname(__file__), ".."))
    args = ap.parse_args()
    repo = os.path.abspath(args.repo)
    out_dir = os.path.join(repo, "tests", "data", "tokenizers")
    os.makedirs(out_dir, exist_ok=True)

    lines = corpus_lines()
    print(f"corpus: {len(lines)} lines, {sum(len(l.encode()) + 1 for l in lines)} bytes")
    sp = train_sp_bpe(lines)
    bl = train_bl_bpe(lines)
    wp = train_wp_bpe(lines)
    tokenizers_list = [
        ("sp_bpe", sp),
        ("bl_bpe", bl),
        ("sp_meta", variant(sp, sp_meta_edit)),
        ("bl_qwen2", variant(bl, bl_qwen2_edit)),
        ("bl_gpt2", variant(bl, bl_gpt2_edit)),
        ("bl_splits", variant(bl, bl_splits_edit)),
        ("wp_bpe", wp),
        ("wp_fused", variant(wp, wp_fused_edit)),
    ]
    for name, tok in tokenizers_list:
        path = os.path.join(out_dir, f"{name}.json")
        data = json.loads(tok.to_str())
        if name in STRING_MERGES:  # the older "a b" serialisation of merges
            merges_as_strings(data)
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(data, fh, ensure_ascii=False, separators=(",", ":"))
        tok = Tokenizer.from_file(path)  # goldens come from the file as saved
        print(f"{path}: vocab {tok.get_vocab_size()}, {os.path.getsize(path)} bytes")
        write_goldens(tok, name, f"tests/data/tokenizers/{name}.json", out_dir)
    # The shipped model's tokenizer, when another task has produced it.
    for path in sorted(glob.glob(os.path.join(repo, "models", "*", "tokenizer.json"))):
        name = os.path.basename(os.path.dirname(path))
        tok = Tokenizer.from_file(path)
        write_goldens(tok, f"model_{name}", os.path.relpath(path, repo), out_dir)


if __name__ == "__main__":
    main()
