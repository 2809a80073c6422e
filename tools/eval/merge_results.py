#!/usr/bin/env python3
"""Merges result JSON files of `veloxquant eval kld|ppl|passkey --json` that were run in parallel
over parts of one method list (tools/eval/sweep.sh) into one file of the same shape.

  merge_results.py OUT.json PART1.json PART2.json ...

Every part holds the full-cache baseline (each run computes it: the top-level "full"/"ppl_full"
of ppl/kld files, the first row of passkey files); the merged file keeps the first part's
top-level fields and baseline, then every part's other rows in the given order.
The parts must agree on their settings and baseline, or the merge is refused.
"""
import json
import sys


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    out, parts = sys.argv[1], sys.argv[2:]
    merged = None
    for path in parts:
        with open(path) as f:
            part = json.load(f)
        rows = part["rows"]
        # ppl/kld files hold the baseline at the top level ("full", "ppl_full"); passkey files
        # as their first row.
        first_is_full = bool(rows) and rows[0].get("family") == "full"
        if "ppl_full" not in part and not first_is_full:
            sys.exit(f"{path}: expected a full-cache baseline (ppl_full, or a first row 'full')")
        if merged is None:
            merged = part
            continue
        for key in ("kind", "settings", "n_docs", "n_prompts", "prefill", "decode", "ppl_full"):
            if merged.get(key) != part.get(key):
                sys.exit(f"{path}: {key} {part.get(key)!r} differs from {merged.get(key)!r}")
        if first_is_full:
            base, other = merged["rows"][0], rows[0]
            for key in ("aware", "agnostic"):
                if key in base and base[key] != other.get(key):
                    sys.exit(f"{path}: the full-cache baseline ({key}) differs between parts")
            rows = rows[1:]
        merged["rows"].extend(rows)
    with open(out, "w") as f:
        json.dump(merged, f, indent=1, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main()
