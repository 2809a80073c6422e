#!/usr/bin/env python3
"""The question-agnostic eviction tables of docs/RESULTS.md (issue 16) from `veloxquant eval
passkey --json` files and tools/peers/kvpress_eval.py files: accuracy (correct / total), by prompt
length, and for our rows the needle survival right after the context was compressed.

Usage: python3 tools/eval/agnostic_table.py OURS.json [...] [--peers PEERS.json ...]
"""

import argparse
import json


def pct(c, t):
    return f"{100.0 * c / t:.1f}" if t else "—"


def our_rows(path):
    d = json.load(open(path))
    rows = d["rows"]  # the full cache first
    for r in rows:
        for mode in ("agnostic", "aware"):
            s = r.get(mode)
            if not s or not s.get("total"):
                continue
            by_len = " / ".join(pct(v["correct"], v["total"])
                                for _, v in sorted(s["by_length"].items(), key=lambda x: int(x[0])))
            n = s.get("needle_prompts") or 0
            whole = f"{100.0 * s['needle_heads_whole_sum'] / n:.1f}" if n else "—"
            yield (r["label"] if r["family"] == "full" else f"`{r['label']}`", mode,
                   f"{pct(s['correct'], s['total'])} ({s['correct']}/{s['total']})", by_len, whole)


def peer_rows(path):
    d = json.load(open(path))
    for r in d["passkey"]:
        for mode in ("agnostic", "aware"):
            if mode not in r:
                continue
            lens = sorted(int(k.split("len")[1]) for k in r if k.startswith(f"{mode}_len"))
            by_len = " / ".join(f"{100.0 * r[f'{mode}_len{L}']:.1f}" for L in lens)
            yield (f"peer: {r['label']}", mode, f"{100.0 * r[mode]:.1f}", by_len, "—")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ours", nargs="+")
    ap.add_argument("--peers", nargs="*", default=[])
    a = ap.parse_args()
    print("| method | mode | passkey % (correct/total) | by length 512 / 1024 / 1800 | "
          "heads with a whole key % |")
    print("| --- | --- | ---: | ---: | ---: |")
    for p in a.ours:
        for row in our_rows(p):
            print("| " + " | ".join(row) + " |")
    for p in a.peers:
        for row in peer_rows(p):
            print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
