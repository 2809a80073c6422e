#!/usr/bin/env python3
"""Peer rows from llama.cpp's quantized KV cache (q8_0, q4_0) on the shipped model, our protocol.

Converts models/vq-mini-llama to GGUF (f32 weights: the bf16 checkpoint widens exactly) with the
convert_hf_to_gguf.py that the llama-cpp-python source package carries (vendor/llama.cpp), then
runs llama.cpp through llama-cpp-python (PyPI, built from source) with K/V cache types f16 (its
uncompressed baseline), q8_0 and q4_0, flash attention on (llama.cpp needs it for a quantized V
cache), and writes JSON rows that `veloxquant eval ... --peers FILE` puts in our tables.

Protocol (veloxquant's text protocol, include/veloxquant/eval.h): rows of
data/eval/heldout_ids.u16; the first P-1 tokens are evaluated in batches of 512 (llama.cpp's
n_batch, like our prefill chunks), then T single-token steps feed x[P-1 .. P+T-2] and score
x[P .. P+T-1]. Token ids go in directly (no llama.cpp tokenization). Perplexity, delta against
llama.cpp's own f16-cache run, KL(p_f16 || p_quant) mean and p99 (nearest rank), top-1 agreement.
Bits per element include the block scale: q8_0 = 32 x 8 bits + one fp16 scale per 32 = 8.5;
q4_0 = 32 x 4 bits + one fp16 scale per 32 = 4.5; f16 = 16.

The converter does not know our tokenizer's pre-tokenizer hash and refuses it; since token ids are
fed directly, the GGUF's tokenizer metadata is never used, so the wrapper below maps an unknown
pre-tokenizer to "gpt-2" (byte-level BPE) and takes the GPT-2 vocab path directly (our tokenizer is
a byte-level BPE; the SentencePiece attempt would need the sentencepiece package).

Setup (keep it out of the shared environment):
  python3 -m venv --system-site-packages /tmp/vqe/venv
  CMAKE_ARGS="-DLLAVA_BUILD=OFF" /tmp/vqe/venv/bin/pip install llama-cpp-python==0.3.36 gguf
  pip download llama-cpp-python==0.3.36 --no-binary :all: --no-deps  # for the converter
Usage:
  /tmp/vqe/venv/bin/python tools/peers/llamacpp_eval.py \
      --converter <sdist>/vendor/llama.cpp/convert_hf_to_gguf.py --docs 8 --out peers_llamacpp.json
"""

import argparse
import json
import math
import os
import subprocess
import sys
import time

import numpy as np

BITS = {"f16": 16.0, "q8_0": 8.5, "q4_0": 4.5}


def log(msg):
    print(f"[llamacpp_eval {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def convert(converter, model_dir, out_path):
    """Runs the converter in a child process with the pre-tokenizer fallback patched in."""
    conv_dir = os.path.dirname(os.path.abspath(converter))
    code = f"""
import sys
sys.path.insert(0, {conv_dir!r})
sys.path.insert(1, {os.path.join(conv_dir, 'gguf-py')!r})
import conversion.base as base
_orig = base.TextModel.get_vocab_base_pre
def _patched(self, tokenizer):
    try:
        return _orig(self, tokenizer)
    except NotImplementedError:
        return "gpt-2"
base.TextModel.get_vocab_base_pre = _patched
import conversion.llama as llama_conv
# Our tokenizer is a byte-level BPE (GPT-2 style): take that vocab path directly instead of trying
# SentencePiece first (which needs the sentencepiece package and finds no tokenizer.model anyway).
llama_conv.LlamaModel.set_vocab = lambda self: self._set_vocab_gpt2()
import runpy
sys.argv = ["convert_hf_to_gguf.py", {model_dir!r}, "--outtype", "f32", "--outfile", {out_path!r}]
runpy.run_path({os.path.abspath(converter)!r}, run_name="__main__")
"""
    subprocess.run([sys.executable, "-c", code], check=True)


def log_softmax(x):
    m = x.max()
    return x - (m + math.log(np.exp(x - m).sum()))


def run(gguf_path, docs, P, T, cache_type, threads):
    import llama_cpp

    types = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0,
             "q4_0": llama_cpp.GGML_TYPE_Q4_0}
    llm = llama_cpp.Llama(model_path=gguf_path, n_ctx=P + T, n_batch=512, n_ubatch=512,
                          n_threads=threads, n_threads_batch=threads, logits_all=True,
                          flash_attn=True, type_k=types[cache_type], type_v=types[cache_type],
                          verbose=False)
    out = []
    for d, ids in enumerate(docs):
        llm.reset()
        llm.eval(ids[:P - 1])
        doc = []
        for t in range(T):
            llm.eval([ids[P - 1 + t]])
            doc.append(np.array(llm.scores[llm.n_tokens - 1], dtype=np.float64))
        out.append(doc)
        log(f"{cache_type}: doc {d + 1}/{len(docs)}")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="models/vq-mini-llama")
    ap.add_argument("--converter", required=True, help="convert_hf_to_gguf.py of llama.cpp")
    ap.add_argument("--gguf", default="/tmp/vqe/vq-mini-llama-f32.gguf")
    ap.add_argument("--heldout", default="data/eval/heldout_ids.u16")
    ap.add_argument("--ctx", type=int, default=2048, help="tokens per row of --heldout")
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("-P", "--prefill", type=int, default=1536)
    ap.add_argument("-T", "--decode", type=int, default=512)
    ap.add_argument("--types", default="q8_0,q4_0")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    import llama_cpp

    if not os.path.exists(a.gguf):
        log(f"converting {a.model} -> {a.gguf}")
        convert(a.converter, a.model, a.gguf)
    heldout = np.fromfile(a.heldout, dtype="<u2")
    docs = [heldout[i * a.ctx:(i + 1) * a.ctx].astype(int).tolist()
            for i in range(min(a.docs, len(heldout) // a.ctx))]
    P, T = a.prefill, a.decode
    base = run(a.gguf, docs, P, T, "f16", a.threads)
    nll_f = [-log_softmax(base[d][t])[docs[d][P + t]] for d in range(len(docs)) for t in range(T)]
    ppl_f = math.exp(sum(nll_f) / len(nll_f))
    rows = [{"label": "llama.cpp f16 cache (its baseline)", "cache_type": "f16", "ppl": ppl_f,
             "delta_ppl_pct": 0.0, "kld_mean": 0.0, "kld_p99": 0.0, "top1_agree": 1.0,
             "bits_per_element": 16.0, "ratio_to_fp16": 1.0}]
    for ct in [t for t in a.types.split(",") if t]:
        got = run(a.gguf, docs, P, T, ct, a.threads)
        nll, kls, top1 = [], [], []
        for d in range(len(docs)):
            for t in range(T):
                lpf = log_softmax(base[d][t])
                lpq = log_softmax(got[d][t])
                nll.append(-lpq[docs[d][P + t]])
                kls.append(float((np.exp(lpf) * (lpf - lpq)).sum()))
                top1.append(int(np.argmax(lpf) == np.argmax(lpq)))
        ppl = math.exp(sum(nll) / len(nll))
        srt = sorted(kls)
        rows.append({"label": f"llama.cpp {ct} K+V cache ({BITS[ct]} bits/element)",
                     "cache_type": ct, "ppl": ppl, "delta_ppl_pct": 100.0 * (ppl / ppl_f - 1.0),
                     "kld_mean": float(np.mean(kls)), "kld_p99": srt[math.ceil(0.99 * len(srt)) - 1],
                     "top1_agree": float(np.mean(top1)), "bits_per_element": BITS[ct],
                     "ratio_to_fp16": BITS[ct] / 16.0})
        log(f"{ct}: ppl {ppl:.4f} vs f16 {ppl_f:.4f}")
    out = {"tool": f"llama.cpp via llama-cpp-python {llama_cpp.__version__} (CPU, flash attention, "
                   f"f32 GGUF weights)", "text": rows, "passkey": []}
    json.dump(out, open(a.out, "w"), indent=1)
    log(f"wrote {a.out}")


if __name__ == "__main__":
    main()
