"""Shared fixtures of the Python tests: a tiny random-initialised Llama (2 layers, hidden 64,
4 heads, 2 KV heads, fp32) and teacher-forced logits through any cache."""

from __future__ import annotations

import inspect
import os
import pathlib

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaModel

import veloxquant  # noqa: F401  (registers attn_implementation="veloxquant")

VOCAB = 128

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "vq-mini-llama"  # the shipped model: 6 layers, 2 KV heads, head_dim 64
DATA = ROOT / "data" / "eval" / "heldout_ids.u16"  # held-out token rows of 2048 ids


def cli_path() -> pathlib.Path:
    """The veloxquant CLI the tests compare against (VQ_CLI, else build/veloxquant)."""
    return pathlib.Path(os.environ.get("VQ_CLI", ROOT / "build" / "veloxquant"))


def heldout_ids(n: int) -> torch.Tensor:
    """The first n ids of the first held-out row, [1, n] int64."""
    rows = np.fromfile(DATA, dtype="<u2").reshape(-1, 2048)
    return torch.from_numpy(rows[:1, :n].astype(np.int64))


@pytest.fixture(scope="module")
def shipped():
    """The shipped model in fp32 through veloxquant's attention."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32,
                                                attn_implementation="veloxquant").eval()

# The cache argument's name: `cache` from transformers 5.3 on (`past_key_values` deprecated),
# `past_key_values` before.
CACHE_ARG = "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters \
    else "past_key_values"


def kv(cache) -> dict:
    """The keyword argument that hands `cache` to a model's forward or generate."""
    return {CACHE_ARG: cache}


def tiny_llama(attn: str = "veloxquant", dtype=torch.float32) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1024, attn_implementation=attn)
    # The default init (std 0.02) gives near-uniform logits; a wider one gives a model whose
    # greedy choices and attention are far from ties, so cache differences show.
    cfg.initializer_range = 0.2
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    model.generation_config.eos_token_id = None  # every generate runs max_new_tokens steps
    return model


@pytest.fixture(scope="session")
def model():
    return tiny_llama()


@pytest.fixture(scope="session")
def prompt():
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, VOCAB, (1, 70), generator=g)  # no pad id (0) inside


@torch.no_grad()
def forced_logits(model, ids: torch.Tensor, cache, n_prefill: int, chunk: int = 0) -> torch.Tensor:
    """Prefill ids[:, :n_prefill] (in chunks of `chunk` tokens, 0 = one call), then one decode
    step per remaining token; returns the logits of every decode step [B, T, V]."""
    chunk = chunk or n_prefill
    for s in range(0, n_prefill, chunk):
        model(ids[:, s:min(s + chunk, n_prefill)], **kv(cache), use_cache=True)
    out = []
    for t in range(n_prefill, ids.shape[1]):
        out.append(model(ids[:, t:t + 1], **kv(cache), use_cache=True).logits[:, -1])
    return torch.stack(out, dim=1) if out else None
