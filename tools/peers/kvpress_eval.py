#!/usr/bin/env python3
"""Peer rows from NVIDIA kvpress (PyPI `kvpress`) on the shipped model, with our protocol.

Runs kvpress's SnapKVPress and StreamingLLMPress (their defaults: SnapKV window 64, avg-pool
kernel 5, GQA score averaging; StreamingLLM 4 sinks) through Hugging Face transformers on the CPU,
and writes JSON rows that `veloxquant eval ... --peers FILE` and `eval report --peers FILE` put in
our tables, marked as peers. kvpress states budgets as compression_ratio = fraction REMOVED;
here every row is labelled by the fraction KEPT (kept = 1 - compression_ratio).

Protocols (the same as veloxquant's eval, see include/veloxquant/eval.h):
  passkey  prompts from data/eval/passkey.jsonl, split at the question " What is the pass key?".
           question-aware: context + question go through the press in one prefill, the answer is
           decoded greedily; question-agnostic: the context alone goes through the press, then the
           question is fed uncompressed (positions continue), then greedy decoding. Exact match of
           the decoded answer (as many tokens as " <key>" has), whitespace-stripped.
           kept fraction = of the compressed part (prompt for aware, context for agnostic).
  text     rows of data/eval/heldout_ids.u16: the first P-1 tokens go through the press in one
           prefill (kvpress compresses a whole prefill at once; we prefill in chunks of 512), then T
           decode steps feed x[P-1 .. P+T-2] with their true positions and score x[P .. P+T-1].
           Perplexity, delta against kvpress's own uncompressed run (same code path, press off),
           KL(p_full || p_press) mean and p99 (nearest rank), top-1 agreement.
Differences from our runtime that remain: fp32 K/V here (ours hands fp16 K/V to every cache), one-
shot prefill, transformers' kernels. Only the difference to its own full run is compared.

Setup (kvpress pins transformers < 5.3, so keep it out of the shared environment):
  python3 -m venv --system-site-packages /tmp/vqe/venv && /tmp/vqe/venv/bin/pip install kvpress==0.5.5
Usage:
  /tmp/vqe/venv/bin/python tools/peers/kvpress_eval.py --model models/vq-mini-llama \
      --kept 0.25,0.5 --prompts 54 --docs 8 --budgets 128,256,512,1024 --out peers_kvpress.json
"""

import argparse
import json
import math
import os
import sys
import time

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import numpy as np
import torch
from tokenizers import Tokenizer

QUESTION = " What is the pass key?"


def log(msg):
    print(f"[kvpress_eval {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# Press kinds: the name in the rows' labels. The question-agnostic presses of issue 16: KVzip
# (context reconstruction, kvpress's defaults: chunk 2048, 4 sinks, budgets shared across layers
# since layerwise=False), expected attention, and AdaKV (head-adaptive budgets) over expected
# attention.
PRESS_NAMES = {"snapkv": "SnapKVPress", "streaming": "StreamingLLMPress", "kvzip": "KVzipPress",
               "expected_attention": "ExpectedAttentionPress",
               "adakv": "AdaKVPress(ExpectedAttentionPress)"}


def make_press(kind, kept):
    import kvpress

    ratio = 1.0 - kept
    if kind == "snapkv":
        return kvpress.SnapKVPress(compression_ratio=ratio)
    if kind == "streaming":
        return kvpress.StreamingLLMPress(compression_ratio=ratio)
    if kind == "kvzip":
        return kvpress.KVzipPress(compression_ratio=ratio)
    if kind == "expected_attention":
        return kvpress.ExpectedAttentionPress(compression_ratio=ratio)
    if kind == "adakv":
        return kvpress.AdaKVPress(kvpress.ExpectedAttentionPress(compression_ratio=ratio))
    raise ValueError(f"unknown press {kind}")


def forward(model, ids, cache, start, want_logits):
    """Runs ids (list of ints) at positions start.. through the model with cache; returns the last
    position's logits (fp32 numpy) or None."""
    x = torch.tensor([ids], dtype=torch.long)
    pos = torch.arange(start, start + len(ids)).unsqueeze(0)
    out = model(input_ids=x, past_key_values=cache, position_ids=pos, logits_to_keep=1,
                use_cache=True)
    return out.logits[0, -1].float().numpy() if want_logits else None


def compressed_prefill(model, ids, cache, press):
    """Prefill ids at positions 0.. with the press active (kvpress compresses after each layer's
    forward, so this call's own outputs saw every row); returns last logits."""
    import contextlib

    with press(model) if press is not None else contextlib.nullcontext():
        return forward(model, ids, cache, 0, True)


def select_prompts(prompts, lengths, max_prompts):
    """The same selection as veloxquant's eval_passkey: filter by target length, then an even
    spread pool[i * n / max] for i < max."""
    pool = [p for p in prompts if not lengths or p["target_length"] in lengths]
    if max_prompts and max_prompts < len(pool):
        return [pool[i * len(pool) // max_prompts] for i in range(max_prompts)]
    return pool


def passkey_run(model, tok, prompts, kind, kept, modes=("aware", "agnostic")):
    from transformers import DynamicCache

    scores = {m: [] for m in modes}
    kept_rows = []
    for i, p in enumerate(prompts):
        at = p["prompt"].rfind(QUESTION)
        ctx = tok.encode(p["prompt"][:at], add_special_tokens=True).ids
        q = tok.encode(p["prompt"][at:], add_special_tokens=False).ids
        n_ans = len(tok.encode(" " + p["answer"], add_special_tokens=False).ids)
        for mode in modes:
            press = make_press(kind, kept) if kind != "full" else None
            cache = DynamicCache()
            with torch.no_grad():
                if mode == "aware":
                    logits = compressed_prefill(model, ctx + q, cache, press)
                    pos = len(ctx) + len(q)
                else:
                    compressed_prefill(model, ctx, cache, press)
                    logits = forward(model, q, cache, len(ctx), True)
                    pos = len(ctx) + len(q)
                # Rows after the compressed prefill (aware: of the prompt; agnostic: of the
                # context, the question's rows added), at the longest prompt.
                if mode == modes[0]:
                    kept_rows.append((cache.get_seq_length(0), pos))
                gen = [int(np.argmax(logits))]
                for _ in range(n_ans - 1):
                    logits = forward(model, [gen[-1]], cache, pos, True)
                    pos += 1
                    gen.append(int(np.argmax(logits)))
            ok = tok.decode(gen, skip_special_tokens=True).strip() == p["answer"]
            scores[mode].append((p, ok))
        if (i + 1) % 10 == 0:
            log(f"passkey {kind} kept={kept}: {i + 1}/{len(prompts)} "
                + " ".join(f"{m} {sum(o for _, o in scores[m])}" for m in modes))
    return scores, kept_rows


def passkey_row(label, scores, kept_rows, kept):
    row = {"label": label, "kept_fraction": kept}
    for mode, res in scores.items():
        row[mode] = sum(ok for _, ok in res) / len(res)
        by_len = {}
        for p, ok in res:
            by_len.setdefault(p["target_length"], []).append(ok)
        for L, oks in sorted(by_len.items()):
            row[f"{mode}_len{L}"] = sum(oks) / len(oks)
    # Memory: rows the cache holds after the prefill over the prompt length, at the longest prompt.
    longest = max(kept_rows, key=lambda x: x[1])
    row["rows_kept"] = float(longest[0])
    row["ratio_to_fp16"] = longest[0] / longest[1]
    return row


def text_run(model, docs, P, T, kind, kept, full_logits=None):
    """Returns (nll list, kl list, top1 list, rows after first step, all logits if full)."""
    from transformers import DynamicCache

    nll, kls, top1, logits_store = [], [], [], []
    rows = None
    for d, ids in enumerate(docs):
        press = make_press(kind, kept) if kind != "full" else None
        cache = DynamicCache()
        doc_logits = []
        with torch.no_grad():
            compressed_prefill(model, ids[:P - 1], cache, press)
            for t in range(T):
                lg = forward(model, [ids[P - 1 + t]], cache, P - 1 + t, True).astype(np.float64)
                if t == 0 and d == 0:
                    rows = cache.get_seq_length(0)
                m = lg.max()
                lp = lg - (m + math.log(np.exp(lg - m).sum()))
                nll.append(-lp[ids[P + t]])
                if full_logits is None:
                    doc_logits.append(lg)
                else:
                    lf = full_logits[d][t]
                    mf = lf.max()
                    lpf = lf - (mf + math.log(np.exp(lf - mf).sum()))
                    kls.append(float((np.exp(lpf) * (lpf - lp)).sum()))
                    top1.append(int(np.argmax(lg) == np.argmax(lf)))
        logits_store.append(doc_logits)
        log(f"text {kind} kept={kept}: doc {d + 1}/{len(docs)} running ppl "
            f"{math.exp(sum(nll) / len(nll)):.4f}")
    return nll, kls, top1, rows, logits_store


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="models/vq-mini-llama")
    ap.add_argument("--passkey", default="data/eval/passkey.jsonl")
    ap.add_argument("--heldout", default="data/eval/heldout_ids.u16")
    ap.add_argument("--presses", default="snapkv,streaming")
    ap.add_argument("--kept", default="0.25,0.5", help="kept fractions for passkey")
    ap.add_argument("--prompts", type=int, default=54)
    ap.add_argument("--lengths", default="", help="only these passkey target lengths")
    ap.add_argument("--budgets", default="128,256,512,1024",
                    help="text: rows kept of the P-1 prefill (kept = budget / (P-1))")
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("-P", "--prefill", type=int, default=1536)
    ap.add_argument("-T", "--decode", type=int, default=512)
    ap.add_argument("--skip-text", action="store_true")
    ap.add_argument("--skip-passkey", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--modes", default="aware,agnostic", help="passkey modes to run")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    import kvpress
    import transformers
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(a.threads)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    model.eval()
    tok = Tokenizer.from_file(f"{a.model}/tokenizer.json")
    presses = [p for p in a.presses.split(",") if p]
    out = {"tool": f"kvpress {kvpress.__version__ if hasattr(kvpress, '__version__') else '0.5.5'}"
                   f" (transformers {transformers.__version__}, torch {torch.__version__}, "
                   f"CPU fp32)",
           "text": [], "passkey": []}

    if not a.skip_passkey:
        prompts = [json.loads(l) for l in open(a.passkey) if l.strip()]
        lengths = [int(x) for x in a.lengths.split(",") if x]
        prompts = select_prompts(prompts, lengths, a.prompts)
        log(f"passkey: {len(prompts)} prompts")
        modes = tuple(m for m in a.modes.split(",") if m)
        scores, rows = passkey_run(model, tok, prompts, "full", 1.0, modes)
        out["passkey"].append(passkey_row("kvpress no press (its full cache)", scores, rows, 1.0))
        for kind in presses:
            for kept in [float(x) for x in a.kept.split(",") if x]:
                scores, rows = passkey_run(model, tok, prompts, kind, kept, modes)
                name = PRESS_NAMES[kind]
                out["passkey"].append(passkey_row(
                    f"kvpress {name} keep {kept:.0%} (compression_ratio {1 - kept:.2f})",
                    scores, rows, kept))
                json.dump(out, open(a.out, "w"), indent=1)

    if not a.skip_text:
        heldout = np.fromfile(a.heldout, dtype="<u2")
        ctx = model.config.max_position_embeddings
        docs = [heldout[i * ctx:(i + 1) * ctx].astype(np.int64).tolist()
                for i in range(min(a.docs, len(heldout) // ctx))]
        P, T = a.prefill, a.decode
        nll_f, _, _, rows_f, full_logits = text_run(model, docs, P, T, "full", 1.0)
        ppl_f = math.exp(sum(nll_f) / len(nll_f))
        out["text"].append({"label": "kvpress no press (its full cache)", "ppl": ppl_f,
                            "delta_ppl_pct": 0.0, "kld_mean": 0.0, "kld_p99": 0.0,
                            "top1_agree": 1.0, "rows_kept": float(rows_f),
                            "ratio_to_fp16": rows_f / P})
        for kind in presses:
            for budget in [int(x) for x in a.budgets.split(",") if x]:
                kept = budget / (P - 1)
                nll, kls, top1, rows, _ = text_run(model, docs, P, T, kind, kept, full_logits)
                ppl = math.exp(sum(nll) / len(nll))
                srt = sorted(kls)
                name = PRESS_NAMES[kind]
                out["text"].append({
                    "label": f"kvpress {name} {budget} rows (keep {kept:.1%})",
                    "ppl": ppl, "delta_ppl_pct": 100.0 * (ppl / ppl_f - 1.0),
                    "kld_mean": float(np.mean(kls)),
                    "kld_p99": srt[math.ceil(0.99 * len(srt)) - 1],
                    "top1_agree": float(np.mean(top1)), "rows_kept": float(rows),
                    "ratio_to_fp16": rows / P})
                json.dump(out, open(a.out, "w"), indent=1)
    json.dump(out, open(a.out, "w"), indent=1)
    log(f"wrote {a.out}")


if __name__ == "__main__":
    main()
