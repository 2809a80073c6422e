#!/usr/bin/env python3
"""Prints the Markdown tables of docs/RESULTS.md from the sweep's JSON (tools/eval/sweep.sh) and
the peers' JSON (tools/peers/*.py), so no figure is copied by hand.

  results_tables.py [--dir docs/results]

Reads DIR/kld.json, DIR/passkey.json, DIR/peers_kvpress.json, DIR/peers_llamacpp.json and, if
present, DIR/attn_error.json.
Sections: eviction (delta ppl and KL by budget), quantization (with bits per element, llama.cpp
beside), composition, passkey by kept fraction (with kvpress beside), and the target checks.
"""
import argparse
import json
import os
import re

BUDGETS = (128, 256, 512, 1024)
KEEPS = (0.125, 0.25, 0.5)


def load(path):
    with open(path) as f:
        return json.load(f)


def spec_fields(label):
    """'snapkv:budget=256:scoring=query' -> ('snapkv', {'budget': '256', 'scoring': 'query'})."""
    parts = label.split(":")
    return parts[0], dict(p.split("=", 1) for p in parts[1:])


def variant_of(label, drop):
    """The label without the keys in drop (budget, keep): the row of a pivot table."""
    method, f = spec_fields(label)
    rest = [f"{k}={v}" for k, v in f.items() if k not in drop]
    return ":".join([method] + rest)


def fmt_pct(x, digits=2):
    return f"{x:+.{digits}f}"


def packed_bits(f, method="skvq"):
    """Bits per element of a packed SKVQ row, metadata (scale and zero per group) included."""
    meta = {"float16": 16, "fp16": 16, "float32": 32, "fp32": 32, "fp8_e4m3": 8}[f.get("meta", "float16")]
    g = int(f.get("group_size", f.get("group", 32)))
    d = 64  # head_dim of the shipped model

    def code_bits(b):  # 1.5 bits: five three-level codes per byte, ceil(D / 5) bytes per row
        b = float(b)
        return 8 * -(-d // 5) / d if b == 1.5 else b

    kb = code_bits(f.get("bits_key", 2)) + 2 * meta / g
    vb = code_bits(f.get("bits_value", 2)) + 2 * meta / g
    if f.get("key_axis") == "channel":
        # Channel-axis keys (packed.h): ceil(2D / shortest block) metadata slots per record; the
        # shortest block is key_rows rows, else chunk 0 (window - n_sink) for skvq, window kept
        # rows for snapkv+skvq (docs/design.md §C4, §C5).
        w, s, r = int(f.get("window", 128)), int(f.get("n_sink", 5)), int(f.get("key_rows", 0))
        shortest = r if r > 0 else (w if method == "snapkv+skvq" else w - s)
        kb = code_bits(f.get("bits_key", 2)) + -(-2 * d // shortest) * meta / d
    return (kb + vb) / 2


def eviction_tables(text, kv):
    rows = {}
    for r in text["rows"]:
        if r["family"] not in ("streaming", "snapkv"):
            continue
        _, f = spec_fields(r["label"])
        if "budget" not in f:
            continue
        rows.setdefault(variant_of(r["label"], {"budget"}), {})[int(f["budget"])] = r
    for p in kv["text"]:
        m = re.match(r"kvpress (\w+) (\d+) rows", p["label"])
        if m:
            rows.setdefault(f"peer: kvpress {m.group(1)}", {})[int(m.group(2))] = p
    out = ["| method (budget = rows kept of P = 1536) | " +
           " | ".join(f"{b} ({100 * b / 1536:.1f}%)" for b in BUDGETS) + " |",
           "| --- |" + " ---: |" * len(BUDGETS)]
    for name, by_b in rows.items():
        cells = []
        for b in BUDGETS:
            r = by_b.get(b)
            cells.append("" if r is None else
                         f"{fmt_pct(r['delta_ppl_pct'])} / {r['kld_mean']:.4f}")
        label = name if name.startswith("peer") else f"`{name}`"
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def quant_table(text, ll):
    out = ["| method | bits / element (packed rows, metadata incl.) | bits / element (whole cache at P) "
           "| ratio to fp16 | Δppl % | KL mean | KL p99 | top-1 agree |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in text["rows"]:
        if r["family"] != "skvq":
            continue
        method, f = spec_fields(r["label"])
        ratio = r["memory"]["ratio_to_fp16"]
        out.append(f"| `{r['label']}` | {packed_bits(f, method):.2f} | {16 * ratio:.2f} | {ratio:.4f} | "
                   f"{fmt_pct(r['delta_ppl_pct'], 3)} | {r['kld_mean']:.5f} | {r['kld_p99']:.5f} | "
                   f"{r['top1_agree']:.4f} |")
    for p in ll["text"]:
        if p["cache_type"] == "f16":
            continue
        out.append(f"| peer: {p['label']} | {p['bits_per_element']:.2f} | {p['bits_per_element']:.2f} | "
                   f"{p['ratio_to_fp16']:.4f} | {fmt_pct(p['delta_ppl_pct'], 3)} | {p['kld_mean']:.5f} | "
                   f"{p['kld_p99']:.5f} | {p['top1_agree']:.4f} |")
    return "\n".join(out)


def combo_table(text):
    out = ["| method | rows kept at P | ratio to fp16 (accounted) | × smaller | Δppl % | KL mean | KL p99 |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in text["rows"]:
        if r["family"] != "snapkv+skvq":
            continue
        m = r["memory"]
        out.append(f"| `{r['label']}` | {m['rows_kept']:.0f} | {m['ratio_to_fp16']:.4f} | "
                   f"{1 / m['ratio_to_fp16']:.1f} | {fmt_pct(r['delta_ppl_pct'])} | {r['kld_mean']:.4f} | "
                   f"{r['kld_p99']:.4f} |")
    return "\n".join(out)


def passkey_tables(pk, kv):
    def acc(mode):
        return 100 * mode["accuracy"]

    rows = {}
    other = []
    for r in pk["rows"]:
        _, f = spec_fields(r["label"])
        if r["family"] in ("streaming", "snapkv") and "keep" in f:
            rows.setdefault(variant_of(r["label"], {"keep"}), {})[float(f["keep"])] = r
        elif r["family"] != "full":
            other.append(r)
    for p in kv["passkey"]:
        m = re.match(r"kvpress (\w+) keep", p["label"])
        if m:
            rows.setdefault(f"peer: kvpress {m.group(1)}", {})[p["kept_fraction"]] = p
    head = ("| method (kept fraction of each prompt's rows) | " +
            " | ".join(f"keep {100 * k:g}%: aware / agnostic" for k in KEEPS) + " |")
    out = [head, "| --- |" + " ---: |" * len(KEEPS)]
    for name, by_k in rows.items():
        cells = []
        for k in KEEPS:
            r = by_k.get(k)
            if r is None:
                cells.append("")
            elif name.startswith("peer"):
                cells.append(f"{100 * r['aware']:.1f} / {100 * r['agnostic']:.1f}")
            else:
                cells.append(f"{acc(r['aware']):.1f} / {acc(r['agnostic']):.1f}")
        label = name if name.startswith("peer") else f"`{name}`"
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    out2 = ["| method | aware % | agnostic % | rows kept at 1797 tokens | ratio to fp16 | × smaller |",
            "| --- | ---: | ---: | ---: | ---: | ---: |"]
    full = pk["rows"][0]
    out2.append(f"| full (baseline) | {acc(full['aware']):.1f} | {acc(full['agnostic']):.1f} | "
                f"{full['memory']['rows_kept']:.0f} | 1.0000 | 1.0 |")
    for r in other:
        m = r["memory"]
        out2.append(f"| `{r['label']}` | {acc(r['aware']):.1f} | {acc(r['agnostic']):.1f} | "
                    f"{m['rows_kept']:.0f} | {m['ratio_to_fp16']:.4f} | {1 / m['ratio_to_fp16']:.1f} |")
    return "\n".join(out), "\n".join(out2)


def attn_table(ae):
    n = ae["n_layers"]
    out = ["| method | " + " | ".join(f"layer {i}" for i in range(n)) + " | mean |",
           "| --- |" + " ---: |" * (n + 1)]
    for r in ae["rows"]:
        out.append(f"| `{r['label']}` | " + " | ".join(f"{x:.4f}" for x in r["layer_rel_l2"]) +
                   f" | {r['mean_rel_l2']:.4f} |")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dir", default="docs/results")
    a = ap.parse_args()
    text = load(os.path.join(a.dir, "kld.json")) if os.path.exists(os.path.join(a.dir, "kld.json")) else None
    pk = load(os.path.join(a.dir, "passkey.json"))
    kv = load(os.path.join(a.dir, "peers_kvpress.json"))
    ll = load(os.path.join(a.dir, "peers_llamacpp.json"))
    if text:
        print("### Eviction: Δppl % / KL mean by budget\n")
        print(eviction_tables(text, kv) + "\n")
        print("### Quantization\n")
        print(quant_table(text, ll) + "\n")
        print("### Eviction and quantization composed\n")
        print(combo_table(text) + "\n")
    t1, t2 = passkey_tables(pk, kv)
    print("### Passkey: eviction by kept fraction (aware / agnostic, %)\n")
    print(t1 + "\n")
    print("### Passkey: quantization and composition\n")
    print(t2)
    ae_path = os.path.join(a.dir, "attn_error.json")
    if os.path.exists(ae_path):
        print("\n### Attention-output error by layer (relative L2 against the full cache)\n")
        print(attn_table(load(ae_path)))


if __name__ == "__main__":
    main()
