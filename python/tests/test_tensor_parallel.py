"""transformers' tensor parallelism (tp_plan="auto", torch.distributed over gloo on the CPU, two
processes) with veloxquant.Cache holding each rank's KV heads: the same greedy tokens as one
process, logits within the bound of the changed fp32 sums, each rank's caches with half the
heads. Skipped where torch.distributed, gloo or accelerate (which transformers needs for
tp_plan) is missing."""

import importlib.util
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

import veloxquant
from conftest import kv, tiny_llama

SPECS = ["full",
         "skvq:bits_key=8:bits_value=8:group_size=16:window=16:n_sink=2",
         # signs of the rank's global heads (kv_heads="auto": tp_kv_heads); with the signs of
         # heads 0.. on rank 1 the rotated keys would differ from one process's
         "skvq:bits_key=8:bits_value=8:group_size=16:window=16:n_sink=2:rotation=hadamard",
         "snapkv+skvq:snap_budget=40:obs_window=8:snap_n_sink=2:bits_key=8:bits_value=8:"
         "group_size=16:skvq_window=16:skvq_n_sink=2:evict_at=prompt_end"]

pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()
         and importlib.util.find_spec("accelerate") is not None),
    reason="needs torch.distributed with gloo and accelerate (transformers' tp_plan)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tp_plan_ranks_hold_their_heads_and_match_one_process(tmp_path, prompt):
    model = tiny_llama()
    model.save_pretrained(tmp_path / "model")
    p = prompt[:, :48]
    torch.save(p, tmp_path / "prompt.pt")
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_port", str(free_port()), os.path.join(here, "tp_worker.py"),
         str(tmp_path / "model"), str(tmp_path), json.dumps(SPECS)],
        env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    cfg = model.config
    # Bound: only o_proj's and down_proj's sums change order (two per layer): each within
    # (K + K/2 + 2) u of its terms' magnitudes, K = max(heads * head_dim, intermediate) = 128,
    # u = 2^-24, carried to the logits with a gain of 8 and magnitudes 4x the outputs (the C++
    # test's derivation, tests/test_tensor_parallel.cpp); the 8-bit SKVQ codes add one step,
    # 8 * 2/255 of the largest |logit|, for an element carried across a rounding boundary.
    k = max(cfg.hidden_size, cfg.intermediate_size)
    fp32 = 2 * cfg.num_hidden_layers * (k + k // 2 + 2) * 2.0 ** -24 * 8 * 4
    for spec in SPECS:
        cache = veloxquant.Cache(spec, model_config=cfg)
        want = model.generate(p, **kv(cache), max_new_tokens=8, do_sample=False,
                              pad_token_id=0, output_scores=True, return_dict_in_generate=True)
        scores = torch.stack(want.scores).flatten()
        bound = (fp32 + (8 * 2 / 255 if "skvq" in spec else 0)) * scores.abs().max().item()
        for r, res in enumerate(ranks):
            got = res[spec]
            assert got["tokens"] == want.sequences[0].tolist(), (spec, r)
            diff = (torch.tensor(got["scores"]) - scores).abs().max().item()
            assert diff <= bound, (spec, r, diff, bound)
            assert got["kv_heads"] == [cfg.num_key_value_heads // 2] * cfg.num_hidden_layers
            half = cfg.num_key_value_heads // 2
            assert got["kv_head_range"] == [r * half, cfg.num_key_value_heads], (spec, r)


def test_tp_kv_heads_outside_torch_distributed_is_not_sharded():
    cfg = tiny_llama().config
    assert veloxquant.tp_kv_heads(cfg) == (0, 0)
    assert veloxquant.Cache("full", model_config=cfg).kv_heads == (0, 0)
    with pytest.raises(ValueError, match="kv_heads: expected 'auto'"):
        veloxquant.Cache("full", model_config=cfg, kv_heads="all")


def test_rank_cache_state_names_its_heads(tmp_path):
    """A rank's cache (kv_heads given) saves its head range and loads only into the same range."""
    import io
    cfg = tiny_llama().config
    spec = "skvq:bits_key=8:bits_value=8:group_size=16:window=16:n_sink=2:rotation=hadamard"
    half = cfg.num_key_value_heads // 2
    cache = veloxquant.Cache(spec, model_config=cfg, kv_heads=(half, cfg.num_key_value_heads))
    g = cfg.num_attention_heads // cfg.num_key_value_heads
    k = torch.randn(1, half, 40, cfg.hidden_size // cfg.num_attention_heads)
    for layer in cache.layers:
        layer.lazy_initialization(k, k)
        layer._cache.attend(k, k, torch.randn(1, g * half, 40, k.shape[-1]),
                            torch.empty(1, g * half, 40, k.shape[-1]), 0.0, 0, False)
    buf = io.BytesIO()
    cache.save(buf)
    same = veloxquant.Cache(spec, model_config=cfg, kv_heads=(half, cfg.num_key_value_heads))
    buf.seek(0)
    same.load(buf)
    for key in ("bytes_accounted", "fp16_bytes"):  # resident bytes follow the allocations
        assert same.memory()[key] == cache.memory()[key], key
    other = veloxquant.Cache(spec, model_config=cfg)
    buf.seek(0)
    with pytest.raises(RuntimeError, match="KV heads"):
        other.load(buf)


def test_rank_cache_is_the_one_process_cache_restricted_to_its_heads():
    """A rank's layer (kv_heads=(first, total)) fed its heads' slice of the K/V and its query
    heads gives, bit for bit, the one-process layer's attention output for those heads: rotated
    4-bit SKVQ, so the Hadamard signs must be the global heads' (with the signs of heads 0..
    on rank 1 the codes, hence the outputs, differ)."""
    spec = "skvq:bits_key=4:bits_value=4:group_size=16:window=16:n_sink=2:rotation=hadamard"
    h, g, d, n = 4, 2, 16, 40
    gen = torch.Generator().manual_seed(3)
    k, v = torch.randn(1, h, n, d, generator=gen), torch.randn(1, h, n, d, generator=gen)
    q = torch.randn(1, h * g, n, d, generator=gen)
    one = veloxquant.CacheLayer(veloxquant.CacheConfig(spec))
    one.lazy_initialization(k, v)
    want = torch.empty_like(q)
    one._cache.attend(k, v, q, want, 0.0, 0, False)
    for r in range(2):
        heads = slice(2 * r, 2 * r + 2)
        qh = slice(2 * r * g, (2 * r + 2) * g)
        layer = veloxquant.CacheLayer(veloxquant.CacheConfig(spec), kv_heads=(2 * r, h))
        # fresh dense copies: contiguous() and clone() keep a batch-1 slice's batch stride,
        # which the extension's contiguity check refuses
        kr, vr, qr = (torch.empty(t.shape).copy_(t) for t in (k[:, heads], v[:, heads], q[:, qh]))
        layer.lazy_initialization(kr, vr)
        got = torch.empty_like(qr)
        layer._cache.attend(kr, vr, qr, got, 0.0, 0, False)
        assert torch.equal(got, want[:, qh]), r
