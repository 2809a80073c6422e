#!/usr/bin/env python3
"""Train the shipped Llama model (vq-mini-llama) on one GPU within a wall-clock budget, keep
the checkpoint best on held-out loss and a passkey probe, then evaluate it.

Steps (each logged):
  1. Data: <data>/train.u16 (uint16 token stream of [bos] doc [eos] documents, written by
     tools/train/prepare_data.py). A training row is ctx+1 tokens: with probability
     --passkey-share a synthetic passkey document (tools/corpus/passkey.py, token space, lengths
     96..ctx) followed by a random slice of the stream, otherwise a random slice of the stream.
     Rows are made by DataLoader worker processes, each seeded from (--seed, worker id).
  2. Model: transformers LlamaForCausalLM, GQA, head_dim 64, context 2048, tied embeddings
     (defaults below: hidden 384, 6 layers, 6 query / 2 KV heads, MLP 1024, vocab 8192).
  3. Optimiser: AdamW (betas 0.9/0.95, weight decay 0.1 on matrices only), gradient clipping
     1.0, linear warm-up then cosine decay to 10% of --lr; bf16 autocast, fp32 master weights.
  4. Budget: without --max-steps, the first --calib-steps steps are timed and the total step
     count is fixed from --train-seconds (printed; pass it as --max-steps to repeat the run).
  5. Tracking: --n-evals times during training, the loss on <data>/valid.u16 (held-out
     validation documents) and a 48-prompt passkey probe (own seed, teacher-forced greedy
     exact match) are measured and a bf16 snapshot is kept in host memory. The shipped
     checkpoint is the one with the highest probe accuracy, ties broken by validation loss.
  6. Save: <out>/model/ (config.json, bf16 safetensors in <= 15 MB shards, tokenizer files).
  7. Evaluate the saved weights upcast to fp32 (TF32 off): held-out perplexity on
     data/eval/heldout_ids.u16 (full 2048 windows, and the docs/design.md §5 protocol P=1536,
     T=512), the unigram baseline on the same tokens, and passkey exact-match accuracy on
     data/eval/passkey.jsonl by length and depth (greedy decoding, full cache).
  Writes <out>/train_log.json and <out>/results.json.
Usage: python3 tools/train/train.py --data .cache/train --out /tmp/run --train-seconds 400
"""

import argparse
import json
import math
import os
import sys
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from transformers import LlamaConfig, LlamaForCausalLM

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tools", "corpus"))
import passkey  # noqa: E402

T0 = time.time()


def log(msg):
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


class Rows(IterableDataset):
    """Endless batches [batch, ctx+1] of int64 token ids (see step 1)."""

    def __init__(self, path, tok_path, ctx, batch, share, seed):
        self.path, self.tok_path = path, tok_path
        self.ctx, self.batch, self.share, self.seed = ctx, batch, share, seed

    def __iter__(self):
        info = get_worker_info()
        wid = info.id if info else 0
        stream = np.memmap(self.path, dtype=np.uint16, mode="r")
        rng = np.random.default_rng([self.seed, wid])
        pk = passkey.TrainingPasskeys(Tokenizer.from_file(self.tok_path), seed=[self.seed, wid, 1],
                                      max_len=self.ctx)
        n = self.ctx + 1
        while True:
            rows = np.empty((self.batch, n), dtype=np.int64)
            for b in range(self.batch):
                fill = 0
                if rng.random() < self.share:
                    doc = pk.sample(stream)[:n]
                    rows[b, :len(doc)] = doc
                    fill = len(doc)
                if fill < n:
                    s = int(rng.integers(0, len(stream) - (n - fill)))
                    rows[b, fill:] = stream[s:s + n - fill]
            yield torch.from_numpy(rows)


def make_config(args):
    return LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.mlp,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
        max_position_embeddings=args.ctx, rope_theta=10000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True, bos_token_id=0, eos_token_id=1, pad_token_id=2,
        attention_bias=False, mlp_bias=False, hidden_act="silu", initializer_range=0.02)


def lr_at(step, total, warmup, peak):
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * t)))


@torch.no_grad()
def valid_loss(model, windows, dev, bs, amp):
    tot, cnt = 0.0, 0
    for i in range(0, len(windows), bs):
        x = windows[i:i + bs].to(dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp):
            logits = model(input_ids=x[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                               reduction="sum")
        tot += loss.item()
        cnt += x[:, 1:].numel()
    return tot / cnt


def build_probe(tok, n_per, lengths):
    pieces = passkey.Pieces(tok)
    rng = np.random.default_rng(passkey.PROBE_SEED)
    groups = []
    for L in lengths:
        xs, starts = [], None
        for depth in np.linspace(0.05, 0.95, 8):
            for _ in range(n_per):
                key = str(int(rng.integers(10000, 100000)))
                _, ids = passkey.build_prompt(pieces, L, float(depth), key)
                ans = pieces.answer_ids(key)
                xs.append(ids + ans)
                starts = len(ids)
        groups.append((torch.tensor(xs), starts, len(ans)))
    digit_ids = torch.tensor([d[0] for d in pieces.digits])
    return groups, digit_ids


@torch.no_grad()
def probe_accuracy(model, groups, digit_ids, dev, amp):
    """Teacher-forced greedy exact match: the argmax at every answer position equals the
    answer token and the argmax after the last digit is not a digit. Equals greedy decoding."""
    correct, total = 0, 0
    for x, start, na in groups:
        x = x.to(dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp):
            logits = model(input_ids=x).logits
        pred = logits[:, start - 1:start - 1 + na + 1].argmax(-1)
        ok = (pred[:, :na] == x[:, start:start + na]).all(-1)
        ok &= ~torch.isin(pred[:, na], digit_ids.to(dev))
        correct += int(ok.sum())
        total += x.shape[0]
    return correct / total


def snapshot(model):
    return {k: v.detach().to("cpu", torch.bfloat16, copy=True) for k, v in model.state_dict().items()}


def train(args, dev, tok):
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    cfg = make_config(args)
    model = LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params} parameters ({n_params * 2 / 1e6:.1f} MB in bf16)")
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=dev.type == "cuda")
    amp = dev.type == "cuda"
    ds = Rows(os.path.join(args.data, "train.u16"), args.tokenizer, args.ctx, args.batch,
              args.passkey_share, args.seed)
    loader = iter(DataLoader(ds, batch_size=None, num_workers=args.workers,
                             pin_memory=dev.type == "cuda", prefetch_factor=4 if args.workers else None,
                             persistent_workers=args.workers > 0))
    vstream = np.fromfile(os.path.join(args.data, "valid.u16"), dtype=np.uint16).astype(np.int64)
    nwin = min(len(vstream) // (args.ctx + 1), args.valid_windows)
    vwin = torch.from_numpy(vstream[:nwin * (args.ctx + 1)].reshape(nwin, args.ctx + 1))
    probe, digit_ids = build_probe(tok, args.probe_per, args.probe_lengths)
    log(f"valid windows {nwin}, probe prompts {sum(g[0].shape[0] for g in probe)}")

    total = args.max_steps
    hist, evals, snaps = [], [], []
    t_train = time.time()
    t_calib = t_train
    step, tok_seen, eval_at = 0, 0, set()
    run_loss, run_n = 0.0, 0

    def do_eval():
        model.eval()
        vl = valid_loss(model, vwin, dev, args.eval_batch, amp)
        pa = probe_accuracy(model, probe, digit_ids, dev, amp)
        model.train()
        evals.append({"step": step, "valid_loss": vl, "valid_ppl": math.exp(vl),
                      "probe_acc": pa, "tokens": tok_seen, "seconds": time.time() - t_train})
        snaps.append(snapshot(model))
        log(f"eval step {step}: valid loss {vl:.4f} (ppl {math.exp(vl):.2f}) probe {pa:.3f}")

    while True:
        if step == 5:
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t_calib = time.time()
        if total is None and step == args.calib_steps:
            if dev.type == "cuda":
                torch.cuda.synchronize()
            per_step = (time.time() - t_calib) / (args.calib_steps - 5)
            # Leave ~8% of the budget for the periodic evaluations.
            total = max(step + 1, int(args.train_seconds * 0.92 / per_step))
            log(f"calibrated: {per_step * 1000:.1f} ms/step -> total steps {total}")
        if total is not None and not eval_at:
            eval_at = {int(round(total * (i + 1) / args.n_evals)) for i in range(args.n_evals)}
        if total is not None and step >= total:
            break
        if time.time() - t_train > 1.15 * args.train_seconds:
            log(f"wall-clock guard: stopping at step {step} of {total}")
            do_eval()
            break
        lr = lr_at(step, total if total is not None else 10 ** 9, args.warmup, args.lr)
        for g in opt.param_groups:
            g["lr"] = lr
        x = next(loader).to(dev, non_blocking=True)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp):
            logits = model(input_ids=x[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tok_seen += x[:, 1:].numel()
        run_loss += loss.detach()
        run_n += 1
        if step % args.log_every == 0:
            l = (run_loss / run_n).item()
            hist.append({"step": step, "loss": l, "lr": lr, "gnorm": float(gnorm),
                         "tokens": tok_seen, "seconds": time.time() - t_train})
            log(f"step {step}/{total} loss {l:.4f} lr {lr:.2e} gnorm {float(gnorm):.2f} "
                f"tok {tok_seen / 1e6:.1f}M")
            run_loss, run_n = 0.0, 0
        if step in eval_at:
            do_eval()
    train_seconds = time.time() - t_train
    if dev.type == "cuda":
        log(f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    best = max(range(len(evals)), key=lambda i: (evals[i]["probe_acc"], -evals[i]["valid_loss"]))
    log(f"selected eval {best}: {evals[best]}")
    model.load_state_dict({k: v.float() for k, v in snaps[best].items()})
    info = {"n_params": n_params, "total_steps": total, "train_seconds": train_seconds,
            "tokens_seen": tok_seen, "train_tokens": int(os.path.getsize(
                os.path.join(args.data, "train.u16")) // 2),
            "selected": evals[best], "evals": evals, "history": hist, "args": vars(args)}
    return model, info


def save_model(model, tok_dir, out_dir):
    import shutil
    model = model.to(torch.bfloat16)
    model.config.use_cache = True
    model.save_pretrained(out_dir, max_shard_size="15MB")
    for fn in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tok_dir, fn), os.path.join(out_dir, fn))
    sizes = {f: os.path.getsize(os.path.join(out_dir, f)) for f in sorted(os.listdir(out_dir))}
    log(f"saved {out_dir}: {sizes}")


@torch.no_grad()
def evaluate(model_dir, args, dev, tok):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                             attn_implementation="sdpa").to(dev).eval()
    res = {}
    # Perplexity on the held-out documents.
    ids = np.fromfile(os.path.join(args.eval_dir, "heldout_ids.u16"), dtype="<u2").astype(np.int64)
    ids = torch.from_numpy(ids.reshape(-1, args.ctx))[:args.eval_docs]
    srcs = [json.loads(l)["source"] for l in open(os.path.join(args.eval_dir, "heldout.jsonl"))]
    nll = []
    for i in range(0, ids.shape[0], 8):
        x = ids[i:i + 8].to(dev)
        logits = model(input_ids=x).logits.float()
        lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, x[:, 1:, None])[..., 0]
        nll.append((-lp).cpu())
    nll = torch.cat(nll)  # [docs, ctx-1]; column j scores token j+1
    P = args.prefix
    stream = np.fromfile(os.path.join(args.data, "train.u16"), dtype=np.uint16)
    counts = np.bincount(stream, minlength=args.vocab).astype(np.float64) + 1.0
    uni = torch.from_numpy(-np.log(counts / counts.sum()))
    uni_nll = uni[ids[:, 1:]]
    res["ppl"] = {
        "docs": int(ids.shape[0]), "ctx": args.ctx, "prefix": P, "scored": args.ctx - P,
        "full_window_ppl": math.exp(nll.mean().item()),
        "protocol_ppl": math.exp(nll[:, P - 1:].mean().item()),
        "unigram_full_window_ppl": math.exp(uni_nll.mean().item()),
        "unigram_protocol_ppl": math.exp(uni_nll[:, P - 1:].mean().item()),
        "per_source_protocol_ppl": {s: math.exp(nll[[i for i, t in enumerate(srcs[:ids.shape[0]])
                                                     if t == s], P - 1:].mean().item())
                                    for s in sorted(set(srcs[:ids.shape[0]]))},
    }
    log(f"perplexity: {res['ppl']}")
    # Passkey retrieval, greedy decoding with the full cache.
    rows = [json.loads(l) for l in open(os.path.join(args.eval_dir, "passkey.jsonl"))]
    by = {}
    for r in rows:
        by.setdefault(r["target_length"], []).append(r)
    acc, detail = {}, {}
    for L, rs in sorted(by.items()):
        encs = [tok.encode(r["prompt"]).ids for r in rs]
        lens = {len(e) for e in encs}
        outs = []
        for ln in sorted(lens):
            sel = [i for i, e in enumerate(encs) if len(e) == ln]
            x = torch.tensor([encs[i] for i in sel], device=dev)
            for j in range(0, len(sel), 32):
                xb = x[j:j + 32]
                g = model.generate(input_ids=xb, attention_mask=torch.ones_like(xb),
                                   max_new_tokens=args.gen_tokens, do_sample=False,
                                   pad_token_id=2)
                for k, i in enumerate(sel[j:j + 32]):
                    outs.append((i, tok.decode(g[k, ln:].tolist(), skip_special_tokens=True)))
        outs.sort()
        ok = [passkey.is_correct(o, rs[i]["answer"]) for i, o in outs]
        acc[L] = sum(ok) / len(ok)
        for (i, o), c in zip(outs, ok):
            d = rs[i]["depth"]
            detail.setdefault(f"{L}", {}).setdefault(f"{d:.1f}", []).append(int(c))
            if not c:
                log(f"passkey miss L={L} depth={d} answer={rs[i]['answer']} got={o!r}")
    res["passkey"] = {"accuracy_by_length": {str(k): v for k, v in acc.items()},
                      "by_length_depth": {L: {d: sum(v) / len(v) for d, v in dd.items()}
                                          for L, dd in detail.items()},
                      "n_prompts": len(rows)}
    log(f"passkey accuracy by length: {acc}")
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=".cache/train")
    ap.add_argument("--tokenizer", default=os.path.join(REPO, "models/vq-mini-llama/tokenizer.json"))
    ap.add_argument("--eval-dir", default=os.path.join(REPO, "data/eval"))
    ap.add_argument("--out", default="/tmp/run")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--mlp", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=150)
    ap.add_argument("--passkey-share", type=float, default=0.2)
    ap.add_argument("--train-seconds", type=float, default=400)
    ap.add_argument("--max-steps", type=int, default=None)
    ap.add_argument("--calib-steps", type=int, default=40)
    ap.add_argument("--n-evals", type=int, default=16)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--valid-windows", type=int, default=10 ** 9)
    ap.add_argument("--eval-batch", type=int, default=16)
    ap.add_argument("--probe-per", type=int, default=2)
    ap.add_argument("--probe-lengths", type=int, nargs="+", default=[512, 1024, 1800])
    ap.add_argument("--eval-docs", type=int, default=10 ** 9)
    ap.add_argument("--prefix", type=int, default=1536)
    ap.add_argument("--gen-tokens", type=int, default=8)
    ap.add_argument("--skip-eval", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    log(f"torch {torch.__version__} device {dev} "
        f"{torch.cuda.get_device_name() if dev.type == 'cuda' else ''}")
    os.makedirs(args.out, exist_ok=True)
    tok = Tokenizer.from_file(args.tokenizer)
    model, info = train(args, dev, tok)
    model_dir = os.path.join(args.out, "model")
    save_model(model, os.path.dirname(args.tokenizer), model_dir)
    del model
    with open(os.path.join(args.out, "train_log.json"), "w") as f:
        json.dump(info, f, indent=1)
    if not args.skip_eval:
        res = evaluate(model_dir, args, dev, tok)
        res["train"] = {k: info[k] for k in ("n_params", "total_steps", "train_seconds",
                                             "tokens_seen", "train_tokens", "selected")}
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(res, f, indent=1)
    log("done")


if __name__ == "__main__":
    main()
