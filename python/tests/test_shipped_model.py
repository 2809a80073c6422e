"""The shipped model (models/vq-mini-llama) in transformers with veloxquant caches, against the
C++ CLI's `eval kld` on the same document and protocol (docs/design.md §5): P - 1 = 511 tokens
prefilled in one call, then T = 32 decode steps, each scored by KL(full || method).

  * byte figures: exact. The caches are the same C++ code fed the same shapes, so the bytes
    accounted at context P equal the CLI's to the byte.
  * KL: both runtimes are fp32 forward passes over the same bf16 weights (the CLI with
    --kv-dtype float32 --matmul exact), in different operation orders: their full-cache logits
    differ at the 1e-6 relative level, and so do the keys and values the caches receive. Codes
    near a rounding boundary and SnapKV scores near a tie flip under such perturbations, and the
    mean over 32 tokens of one document moves with them, most for the smallest KL (K4V4, whose
    few largest per-token KLs dominate the mean). The band is measured, not derived: scaling
    the K/V projection weights by (1 + 2e-6 N(0,1)) (the fp32 rounding level) moves Python's K4V4
    KL over 0.0098 .. 0.0141 (unperturbed 0.0130; the CLI's 0.0107 lies inside), while K2V2,
    SnapKV and snapkv+skvq agree with the CLI to 0.1%. Both sides move within such a spread, so
    their difference may reach its whole width (0.0043, half the smaller KL); and on CPUs with
    AVX-512 VNNI both run the int8-query key kernel (docs/design.md section 4), which moved K4V4
    to 0.0119 (Python) and 0.0087 (CLI) on the development machine: a gap of 37% of the CLI's KL.
    The test allows 50% of the CLI's KL plus 1e-3 nats. A wrong cache (another method, wrong
    positions, dropped queries) moves the KL by far more (K2V2: 16x K4V4's).
"""

import json
import os
import subprocess

import pytest
import torch
from transformers import AutoModelForCausalLM

import veloxquant
from conftest import DATA, MODEL, cli_path, forced_logits, heldout_ids, kv

P, T = 512, 32
METHODS = ["skvq:bits_key=4:bits_value=4", "skvq:bits_key=2:bits_value=2", "snapkv:budget=128",
           "snapkv+skvq:budget=128:bits_key=4:bits_value=4"]


@pytest.fixture(scope="module")
def doc():
    return heldout_ids(P + T)


@pytest.fixture(scope="module")
def cli_rows():
    cli = cli_path()
    if not cli.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{cli} not built: scripts/test.sh builds it before the Python step")
        pytest.skip(f"{cli} not built (set VQ_CLI)")
    out = subprocess.run(
        [str(cli), "eval", "kld", "--model", str(MODEL), "--data", str(DATA), "--row-len", "2048",
         "-P", str(P), "-T", str(T), "--docs", "1", "--kv-dtype", "float32", "--matmul", "exact",
         "--methods", ",".join(METHODS), "--json", "--quiet"],
        check=True, capture_output=True, text=True).stdout
    return {r["label"]: r for r in json.loads(out)["rows"]}


def kl_mean(full: torch.Tensor, method: torch.Tensor) -> float:
    lf = torch.log_softmax(full.double(), dim=-1)
    lm = torch.log_softmax(method.double(), dim=-1)
    return float((lf.exp() * (lf - lm)).sum(-1).mean())


def test_loads_and_full_matches_sdpa(shipped, doc):
    ref = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32,
                                               attn_implementation="sdpa").eval()
    from transformers import DynamicCache
    ids = doc[:, :96]
    got = forced_logits(shipped, ids, veloxquant.Cache("full"), 80)
    want = forced_logits(ref, ids, DynamicCache(), 80)
    # As in test_generate.py: two fp32 paths of one network; same greedy choices here.
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    out = shipped.generate(doc[:, :64], **kv(veloxquant.Cache("snapkv+skvq:budget=32")),
                           max_new_tokens=8, do_sample=False)
    assert out.shape == (1, 72)


def test_kl_and_bytes_match_the_cli(shipped, doc, cli_rows):
    full = forced_logits(shipped, doc[:, :P + T - 1], veloxquant.Cache("full"), P - 1)
    kls = {}
    for spec in METHODS:
        cache = veloxquant.Cache(spec)
        logits = []
        with torch.no_grad():
            shipped(doc[:, :P - 1], **kv(cache), use_cache=True)
            for t in range(T):
                logits.append(shipped(doc[:, P - 1 + t:P + t], **kv(cache),
                                      use_cache=True).logits[:, -1])
                if t == 0:  # the CLI's memory figures are taken at context P
                    mem = cache.memory()
        kls[spec] = kl_mean(full, torch.stack(logits, dim=1))
        row = cli_rows[spec]
        assert mem["bytes_accounted"] == row["memory"]["bytes_accounted"], spec
        assert mem["fp16_bytes"] == row["memory"]["fp16_bytes"], spec
        cli_kl = row["kld_mean"]
        print(f"{spec}: KL python {kls[spec]:.5f} cli {cli_kl:.5f} "
              f"ratio {mem['ratio_to_fp16']:.4f}")
        assert abs(kls[spec] - cli_kl) <= 0.5 * cli_kl + 1e-3, spec
    assert kls[METHODS[1]] > 5 * kls[METHODS[0]]  # 2 bits lose more than 4
