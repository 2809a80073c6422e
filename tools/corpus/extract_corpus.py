#!/usr/bin/env python3
"""Extract a clean plain-text English corpus from Debian text packages.

Sources (Debian packages; `apt-get install -y <names>` before running):
  bible-kjv bible-kjv-text   King James Bible, via the `bible` program
  dict-gcide                 GNU Collaborative International Dictionary of English
  dict-foldoc dict-jargon dict-devil   FOLDOC, the Jargon File, The Devil's Dictionary
  fortunes fortunes-min      fortune cookie files (the ASCII-art files are skipped)
  python3.11-doc             Python 3.11 documentation, reStructuredText sources

Output: <out>/docs.jsonl, one JSON object per line: {"id", "source", "split", "text"}.
A document is a run of consecutive units (Bible chapters of one book, dictionary entries,
fortunes) of at least --min-chars characters, or one Python documentation page. The split is
a fixed function of the document id (SHA-1), so it never depends on the run or the machine:
  test  ~3.0%  held-out evaluation documents (data/eval/, never trained on)
  valid ~1.5%  held-out validation documents (checkpoint selection during training)
  train        the rest
Usage: python3 tools/corpus/extract_corpus.py --out corpus
"""

import argparse
import gzip
import hashlib
import json
import os
import re
import subprocess
import sys
import unicodedata

DICTD = "/usr/share/dictd"
FORTUNES = "/usr/share/games/fortunes"
PYDOC = "/usr/share/doc/python3.11/html/_sources"
SKIP_FORTUNES = {"art", "ascii-art"}

# Split thresholds in units of 1/1000 of the SHA-1 value of the id.
TEST_PER_MILLE = 30
VALID_PER_MILLE = 45


def split_of(doc_id):
    h = int(hashlib.sha1(doc_id.encode("utf-8")).hexdigest()[:8], 16) % 1000
    if h < TEST_PER_MILLE:
        return "test"
    if h < VALID_PER_MILLE:
        return "valid"
    return "train"


def clean_text(text):
    """Normalise to NFC, drop control characters except newline/tab, trim line ends,
    collapse runs of more than one blank line."""
    text = unicodedata.normalize("NFC", text)
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    # Overstriking (char BACKSPACE char) appears in some fortunes: keep the final char.
    text = re.sub(r".\x08", "", text)
    text = "".join(c for c in text if c in "\n\t" or unicodedata.category(c)[0] != "C")
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip()


def group_units(units, min_chars, sep):
    """Concatenate consecutive units until each group has at least min_chars characters."""
    groups, cur, n = [], [], 0
    for u in units:
        cur.append(u)
        n += len(u) + len(sep)
        if n >= min_chars:
            groups.append(sep.join(cur))
            cur, n = [], 0
    if cur:
        groups.append(sep.join(cur))
    return groups


# ---------------------------------------------------------------- Bible
def bible_docs(min_chars):
    out = subprocess.run(["bible", "-l", "100000", "gen1:1-rev22:21"], capture_output=True,
                         text=True, check=True, env=dict(os.environ, COLUMNS="100000")).stdout
    # Pretty-printed output: a line "Book N" opens a chapter, verses are "  V text".
    chapters = []  # (book, chapter text)
    head_re = re.compile(r"^([1-3]? ?[A-Z][A-Za-z ]*?) (\d+)$")
    for line in out.split("\n"):
        m = head_re.match(line)
        if m:
            chapters.append([m.group(1), [f"{m.group(1)} {m.group(2)}", ""]])
        elif line.strip() and chapters:
            chapters[-1][1].append(line.strip())
    if len(chapters) != 1189:
        raise RuntimeError(f"[bible] expected 1189 chapters but got {len(chapters)}")
    docs, book_units, book = [], [], None
    for b, lines in chapters + [[None, []]]:
        if b != book and book_units:
            for i, g in enumerate(group_units(book_units, min_chars, "\n\n")):
                docs.append((f"bible/{book}/{i}", g))
            book_units = []
        book = b
        if b is not None:
            book_units.append("\n".join(lines))
    return docs


# ---------------------------------------------------------------- dictd databases
B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def b64num(s):
    n = 0
    for c in s:
        n = n * 64 + B64.index(c)
    return n


def dict_entries(name):
    with gzip.open(os.path.join(DICTD, name + ".dict.dz"), "rb") as f:
        data = f.read()
    seen, entries = set(), []
    with open(os.path.join(DICTD, name + ".index"), "r", encoding="utf-8", errors="replace") as f:
        for line in f:
            parts = line.rstrip("\n").split("\t")
            if len(parts) < 3 or parts[0].startswith("00-database") or parts[0].startswith("00database"):
                continue
            off, ln = b64num(parts[1]), b64num(parts[2])
            if off in seen:
                continue
            seen.add(off)
            entries.append((off, data[off:off + ln].decode("utf-8", errors="replace")))
    entries.sort()
    return [e for _, e in entries]


def clean_gcide(entry):
    lines = []
    for line in entry.split("\n"):
        if re.fullmatch(r"\s*\[[^\]]*\]\s*", line):  # source tags like [1913 Webster]
            continue
        line = re.sub(r"\\[^\\\n]*\\", "", line)  # pronunciation \Ab*do"men\
        line = line.replace("{", "").replace("}", "")
        lines.append(line.strip())
    text = "\n".join(lines)
    text = re.sub(r" +([,.;])", r"\1", text)
    return re.sub(r"\n{2,}", "\n", text).strip()


def clean_dict_generic(entry):
    text = entry.replace("{", "").replace("}", "")
    return "\n".join(l.strip() for l in text.split("\n")).strip()


def dict_docs(name, min_chars):
    cleaner = clean_gcide if name == "gcide" else clean_dict_generic
    units = [cleaner(e) for e in dict_entries(name)]
    units = [u for u in units if len(u) > 20]
    return [(f"{name}/{i}", g) for i, g in enumerate(group_units(units, min_chars, "\n\n"))]


# ---------------------------------------------------------------- fortunes
def fortune_docs(min_chars):
    docs = []
    for fn in sorted(os.listdir(FORTUNES)):
        path = os.path.join(FORTUNES, fn)
        if "." in fn or fn in SKIP_FORTUNES or os.path.islink(path) or not os.path.isfile(path):
            continue
        with open(path, "rb") as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = raw.decode("latin-1")
        units = [u.strip("\n") for u in re.split(r"\n%\n", text) if u.strip()]
        units = [re.sub(r"\t+", "    ", u) for u in units]
        for i, g in enumerate(group_units(units, min_chars, "\n\n")):
            docs.append((f"fortunes/{fn}/{i}", g))
    return docs


# ---------------------------------------------------------------- Python docs
def clean_rst(text):
    text = re.sub(r":[a-z:]+:`~?([^`<]*?)(?:\s*<[^>]*>)?`", r"\1", text)  # :role:`x <y>` -> x
    text = re.sub(r"`([^`<]+?)\s*<[^>]*>`_+", r"\1", text)  # `text <url>`_ -> text
    text = re.sub(r"``([^`]+)``", r"\1", text)
    text = re.sub(r"^\s*\.\. (index|highlight|module|moduleauthor|sectionauthor|testsetup|"
                  r"testcleanup|_[^:]*):.*$", "", text, flags=re.M)
    text = re.sub(r"^([=\-~^\"'*+#])\1{3,}\s*$", "", text, flags=re.M)  # heading underlines
    return text


def pydoc_docs():
    docs = []
    for root, _, files in sorted(os.walk(PYDOC)):
        for fn in sorted(files):
            if not fn.endswith(".txt"):
                continue
            path = os.path.join(root, fn)
            with open(path, "r", encoding="utf-8", errors="replace") as f:
                text = clean_rst(f.read())
            if len(text) > 500:
                docs.append(("pydoc/" + os.path.relpath(path, PYDOC), text))
    return docs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="corpus")
    ap.add_argument("--min-chars", type=int, default=12000,
                    help="minimum characters per grouped document (~3000 tokens)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    all_docs = []
    all_docs += [("bible", d) for d in bible_docs(args.min_chars)]
    for name in ("gcide", "foldoc", "jargon", "devil"):
        all_docs += [(name, d) for d in dict_docs(name, args.min_chars)]
    all_docs += [("fortunes", d) for d in fortune_docs(args.min_chars)]
    all_docs += [("pydoc", d) for d in pydoc_docs()]
    stats = {}
    path = os.path.join(args.out, "docs.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for source, (doc_id, text) in all_docs:
            text = clean_text(text)
            if not text:
                continue
            split = split_of(doc_id)
            s = stats.setdefault(source, {"train": [0, 0], "valid": [0, 0], "test": [0, 0]})
            s[split][0] += 1
            s[split][1] += len(text)
            f.write(json.dumps({"id": doc_id, "source": source, "split": split, "text": text},
                               ensure_ascii=False) + "\n")
    for source, s in stats.items():
        print(f"{source:9s} " + "  ".join(f"{k}: {v[0]} docs {v[1] / 1e6:.2f}M chars"
                                          for k, v in s.items()))
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
