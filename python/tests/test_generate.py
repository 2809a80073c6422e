"""Every method through transformers' generate on the tiny random Llama (conftest.py), the full
method against DynamicCache, batches, refusals and the packed memory figures."""

import pytest
import torch
from transformers import DynamicCache

import veloxquant
from conftest import forced_logits, kv, tiny_llama

SPECS = {
    "full": "full",
    "snapkv": "snapkv:budget=24:obs_window=8",
    "skvq": "skvq:bits_key=4:bits_value=4:window=16:group_size=8:n_sink=2",
    "snapkv+skvq": "snapkv+skvq:budget=24:obs_window=8:bits_key=4:bits_value=4:window=8:"
                   "group_size=8:skvq_n_sink=2:snap_n_sink=2",
    "streaming": "streaming:window=20:n_sink=4",
}
N_NEW = 24


def greedy(model, ids, cache):
    return model.generate(ids, **kv(cache), max_new_tokens=N_NEW, do_sample=False,
                          pad_token_id=0)


@pytest.mark.parametrize("method", list(SPECS))
def test_every_method_generates(model, prompt, method):
    cache = veloxquant.Cache(SPECS[method])
    out = greedy(model, prompt, cache)
    assert out.shape == (1, prompt.shape[1] + N_NEW)
    n_seen = prompt.shape[1] + N_NEW - 1  # the last token is never fed back
    assert cache.get_seq_length() == n_seen
    assert len(cache.layers) == model.config.num_hidden_layers
    for st in cache.stats():
        assert st["method"] == method and st["tokens_seen"] == n_seen


def test_full_matches_dynamic_cache_tokens(model, prompt):
    ref_model = tiny_llama("sdpa")
    ref = greedy(ref_model, prompt, DynamicCache())
    got = greedy(model, prompt, veloxquant.Cache("full"))
    assert torch.equal(got, ref)


def test_full_logits_within_fp32_bound(model, prompt):
    """Teacher-forced logits (prefill 40 in two calls, 30 decode steps) of the full method against
    transformers' fp32 eager and SDPA paths, all against an fp64 run of the same model.

    Bound: every path is an fp32 evaluation of the same network; outside attention they run the
    same torch kernels, and each attention kernel's error has the same form (about n u sum_j
    w_j |v_j|, test_attention_op.py; n <= 70 here), only the summation order differs. So our
    error against fp64 is at most twice the larger of transformers' own two fp32 errors."""
    l_vq = forced_logits(model, prompt, veloxquant.Cache("full"), 40, chunk=25)
    l_64 = forced_logits(tiny_llama("eager", torch.float64), prompt, DynamicCache(), 40, 25)
    e_ref = max(float((forced_logits(tiny_llama(a), prompt, DynamicCache(), 40, 25).double()
                       - l_64).abs().max()) for a in ("eager", "sdpa"))
    e_vq = float((l_vq.double() - l_64).abs().max())
    assert 0 < e_ref < 1e-3
    assert e_vq <= 2 * e_ref, f"ours {e_vq:.3g} vs transformers' fp32 {e_ref:.3g}"


def test_snapkv_keeps_budget_and_positions(model, prompt):
    cache = veloxquant.Cache("snapkv:budget=24:obs_window=8")
    forced_logits(model, prompt, cache, 60)
    layer = cache.layers[0]
    # One prefill call of 60 tokens evicts to the budget; 10 decode rows follow.
    assert layer._cache.stored_rows == 24 + 10
    pos = layer.stored_positions(0, 1)
    assert pos == sorted(set(pos)) and pos[:4] == [0, 1, 2, 3]  # sinks kept, ascending, unique
    assert pos[-10:] == list(range(60, 70))
    assert cache.get_seq_length() == 70  # true positions, not rows: RoPE is unaffected


def test_snapkv_query_scoring_sees_the_queries(model, prompt):
    """scoring=query selects with the real queries of the observation window: another
    selection than the key proxy's (the cache receives the queries from the attention call)."""
    kept = {}
    for scoring in ("key_proxy", "query"):
        cache = veloxquant.Cache(f"snapkv:budget=16:obs_window=8:scoring={scoring}")
        forced_logits(model, prompt, cache, 60)
        kept[scoring] = [cache.layers[i].stored_positions(0, h) for i in range(2) for h in range(2)]
    assert kept["query"] != kept["key_proxy"]


def test_memory_figures_exact(model, prompt):
    n = prompt.shape[1]
    layers, heads, d = 2, 2, 16
    fp16 = layers * 2 * heads * d * 2 * n  # K and V of every token at 2 bytes
    full = veloxquant.Cache("full")
    forced_logits(model, prompt, full, n)
    mem = full.memory()
    assert mem["fp16_bytes"] == fp16
    assert mem["bytes_accounted"] == 2 * fp16  # the fp32 model's rows are kept in fp32
    snap = veloxquant.Cache("snapkv:budget=24:obs_window=8")
    forced_logits(model, prompt, snap, n)
    assert snap.memory()["bytes_accounted"] == layers * 2 * heads * d * 2 * 24  # kept rows, fp16
    skvq = veloxquant.Cache("skvq:bits_key=4:bits_value=4:window=16:group_size=8:n_sink=2")
    forced_logits(model, prompt, skvq, n)
    m = skvq.memory()
    assert m["fp16_bytes"] == fp16 and m["bytes_resident"] > 0
    assert m["ratio_to_fp16"] < 0.6  # 4-bit codes + fp16 metadata per 8 channels + a window
    assert m == {k: v for k, v in skvq.memory().items()}


def test_batch_of_equal_lengths_matches_single_runs(model):
    """B > 1 (equal lengths): each sequence is generated as if alone, except where the method
    pools over the batch: SKVQ's channel reorder is computed from chunk 0 over every sequence
    (docs/design.md §C4), so with reorder on, a sequence's codes depend on its neighbours."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 128, (2, 30), generator=g)
    for spec in ("full", SPECS["skvq"] + ":reorder=false", SPECS["snapkv"]):
        both = greedy(model, ids, veloxquant.Cache(spec))
        for b in range(2):
            one = greedy(model, ids[b:b + 1], veloxquant.Cache(spec))
            assert torch.equal(both[b:b + 1], one), spec


def test_padded_batch_refused(model):
    ids = torch.randint(3, 128, (2, 12))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding: per-sequence positions
    with pytest.raises(ValueError, match="padded batches"):
        model.generate(ids, attention_mask=mask, **kv(veloxquant.Cache("full")),
                       max_new_tokens=4, do_sample=False, pad_token_id=0)


def test_beam_search_and_crop_refused(model, prompt):
    with pytest.raises(RuntimeError, match="reorder_cache"):
        model.generate(prompt, **kv(veloxquant.Cache(SPECS["skvq"])), num_beams=2,
                       max_new_tokens=4, do_sample=False, pad_token_id=0)
    cache = veloxquant.Cache(SPECS["skvq"])
    forced_logits(model, prompt, cache, 60)
    with pytest.raises(RuntimeError, match="crop"):
        cache.crop(3)
    assert cache.get_seq_length() == 70  # nothing changed
    full = veloxquant.Cache("full")
    forced_logits(model, prompt, full, 60)
    full.crop(3)
    assert full.get_seq_length() == 67


def test_other_attention_implementation_refused(prompt):
    sdpa = tiny_llama("sdpa")
    with pytest.raises(RuntimeError, match="attn_implementation='veloxquant'"):
        sdpa.generate(prompt, **kv(veloxquant.Cache("full")), max_new_tokens=3,
                      do_sample=False, pad_token_id=0)


def test_bfloat16_model(prompt):
    """bf16 activations: the caches take bf16 blocks as they are (no copy); the full method
    stores them in bf16 (2 bytes per element)."""
    m = tiny_llama("veloxquant", torch.bfloat16)
    cache = veloxquant.Cache("full")
    out = greedy(m, prompt, cache)
    assert out.shape[1] == prompt.shape[1] + N_NEW
    assert cache.memory()["ratio_to_fp16"] == 1.0


def test_fallback_without_our_cache_matches_sdpa(model, prompt):
    """attn_implementation="veloxquant" with a DynamicCache falls back to SDPA with a
    bottom-right causal mask (no mask is built for this implementation): chunked prefill and
    decode give SDPA's logits."""
    ref = forced_logits(tiny_llama("sdpa"), prompt, DynamicCache(), 40, chunk=25)
    got = forced_logits(model, prompt, DynamicCache(), 40, chunk=25)
    assert torch.equal(got, ref)


def test_forward_outside_no_grad(model, prompt):
    """A plain forward (autograd on, as in a user's script) runs: the step is inference only."""
    cache = veloxquant.Cache("full")
    out = model(prompt, **kv(cache), use_cache=True)
    assert out.logits.shape == (1, prompt.shape[1], 128)
