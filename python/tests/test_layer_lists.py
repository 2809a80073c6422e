"""Per-layer key precision (skvq_layer_bits_key / skvq_layer_key_rows, docs/design.md §C4) in the
Python cache: layer i of a veloxquant.Cache takes entry i of the lists, as the C++ builders
(build_caches, the CUDA engine) give it, whether the layers are made up front (model_config,
num_layers) or lazily by transformers at their first update.

Bytes are exact formulas: with token-axis keys of b bits, group size 32 and fp16 (lo, scale)
pairs, a packed row of one KV head holds ceil(D b / 8) code bytes (ceil(D / 5) at 1.5 bits: five
ternary codes a byte) and D / 32 * 2 * 2 metadata bytes, so a layer's compressed key bytes are
packed_rows * B * H_kv * that, and differ by layer as its entry says.
"""

import io
import json
import math
import os
import subprocess

import pytest
import torch

import veloxquant
from veloxquant import _veloxquant as _vq
from conftest import DATA, MODEL, cli_path, heldout_ids, kv

BITS = [4, 2, 3, 2, 8, 1.5]  # one entry per layer of the shipped model, no two neighbours equal
LIST = "/".join(f"{b:g}" for b in BITS)
SPEC = f"skvq:bits_value=2:window=16:n_sink=2:layer_bits_key={LIST}"
D, H_KV, GROUP = 64, 2, 32


def key_row_bytes(bits: float) -> int:
    """Bytes of one packed key row of one head (codes + fp16 lo/scale per group of 32)."""
    codes = math.ceil(D / 5) if bits == 1.5 else math.ceil(D * bits / 8)
    return codes + D // GROUP * 2 * 2


def scalar_spec(bits: float) -> str:
    return f"skvq:bits_value=2:window=16:n_sink=2:bits_key={bits:g}"


def io_bytes(cache) -> io.BytesIO:
    """The state file of `cache`, ready to load."""
    buf = io.BytesIO()
    cache.save(buf)
    buf.seek(0)
    return buf


@pytest.fixture(scope="module")
def doc():
    return heldout_ids(96)


def check_layers_take_their_entries(cache, batch: int = 1):
    assert len(cache.layers) == len(BITS)
    for i, (layer, bits) in enumerate(zip(cache.layers, BITS)):
        assert layer.layer_idx == i and layer._cache.layer == i
        fig = layer.stats()["figures"]
        packed = int(fig["packed_rows"])
        assert packed > 0, i
        assert fig["compressed_key_bytes"] == packed * batch * H_KV * key_row_bytes(bits), i
        # the value bytes are the single field's, the same in every layer
        assert fig["compressed_value_bytes"] == packed * batch * H_KV * key_row_bytes(2), i


@pytest.mark.parametrize("made", ["model_config", "num_layers", "lazily"])
def test_generate_gives_each_layer_its_entry(shipped, doc, made):
    if made == "model_config":
        cache = veloxquant.Cache(SPEC, model_config=shipped.config)
    elif made == "num_layers":
        cache = veloxquant.Cache(SPEC, num_layers=len(BITS))
    else:
        cache = veloxquant.Cache(SPEC)
        assert len(cache.layers) == 0
    out = shipped.generate(doc[:, :64], **kv(cache), max_new_tokens=8, do_sample=False)
    assert out.shape == (1, 72)
    check_layers_take_their_entries(cache)
    sizes = {layer.stats()["figures"]["compressed_key_bytes"] for layer in cache.layers}
    assert len(sizes) == len(set(BITS))  # 4, 2, 3, 8 and 1.5 bits: five different sizes


def test_layer_is_the_single_field_cache_of_its_entry(shipped, doc):
    """Layer i's state is the single-field cache's (bits_key = entry i) at layer i: it loads into
    that cache and saves back to the same bytes with the same figures, and the cache of another
    entry refuses it, naming the bits."""
    cache = veloxquant.Cache(SPEC, model_config=shipped.config)
    with torch.no_grad():
        shipped(doc[:, :80], **kv(cache), use_cache=True)
    for i, layer in enumerate(cache.layers):
        blob = layer._cache.save()
        one = _vq.LayerCache(veloxquant.CacheConfig(scalar_spec(BITS[i])).to_json(), D, layer=i)
        one.load(blob)
        assert one.save() == blob, i
        # every figure but the resident bytes, which follow the allocations (growth slack)
        got, want = one.stats(), layer.stats()
        del got["bytes_resident"], want["bytes_resident"]
        assert got == want, i
        other = BITS[i - 1]  # the previous layer's entry (differs from this one's)
        wrong = _vq.LayerCache(veloxquant.CacheConfig(scalar_spec(other)).to_json(), D, layer=i)
        with pytest.raises(RuntimeError, match="skvq_bits_key"):
            wrong.load(blob)
    # the whole cache's state file round-trips through a lazily made cache (layer i -> entry i)
    back = veloxquant.Cache(SPEC)
    back.load(io_bytes(cache))
    assert [layer._cache.layer for layer in back.layers] == list(range(len(BITS)))
    for key in ("bytes_accounted", "fp16_bytes"):
        assert back.memory()[key] == cache.memory()[key], key


def test_bytes_match_the_cli_builder(shipped):
    """The CLI's caches (build_caches) of the same spec on the same protocol account the same
    bytes at context P as the Python layers (the figures depend on row counts, not values)."""
    cli = cli_path()
    if not cli.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{cli} not built: scripts/test.sh builds it before the Python step")
        pytest.skip(f"{cli} not built (set VQ_CLI)")
    p, t = 96, 2
    out = subprocess.run(
        [str(cli), "eval", "kld", "--model", str(MODEL), "--data", str(DATA), "--row-len", "2048",
         "-P", str(p), "-T", str(t), "--docs", "1", "--kv-dtype", "float32", "--matmul", "exact",
         "--methods", SPEC, "--json", "--quiet"],
        check=True, capture_output=True, text=True).stdout
    row = {r["label"]: r for r in json.loads(out)["rows"]}[SPEC]
    ids = heldout_ids(p + t)
    cache = veloxquant.Cache(SPEC)
    with torch.no_grad():
        shipped(ids[:, :p - 1], **kv(cache), use_cache=True)
        shipped(ids[:, p - 1:p], **kv(cache), use_cache=True)  # context P, as the CLI's figures
    assert cache.memory()["bytes_accounted"] == row["memory"]["bytes_accounted"]
    # and not the bytes of every layer at entry 0
    first = veloxquant.Cache(scalar_spec(BITS[0]))
    with torch.no_grad():
        shipped(ids[:, :p], **kv(first), use_cache=True)
    assert first.memory()["bytes_accounted"] != row["memory"]["bytes_accounted"]


def test_no_layer_index_refuses_the_lists():
    json_cfg = veloxquant.CacheConfig(SPEC).to_json()
    with pytest.raises(ValueError) as e:
        _vq.LayerCache(json_cfg, D)
    msg = str(e.value)
    assert "[veloxquant.Cache] layer: expected the model layer this cache serves" in msg
    assert f"skvq_layer_bits_key '{LIST}'" in msg and "but got none" in msg
    with pytest.raises(ValueError, match="layer: expected >= 0"):
        _vq.LayerCache(json_cfg, D, layer=-1)
    # without the lists a layer needs no index (the cache is layer 0's), as before
    assert _vq.LayerCache(veloxquant.CacheConfig(scalar_spec(4)).to_json(), D).layer is None
    # a CacheLayer made by hand, without an index, refuses them at its first update
    layer = veloxquant.CacheLayer(veloxquant.CacheConfig(SPEC))
    k = torch.zeros(1, H_KV, 4, D)
    with pytest.raises(ValueError, match="but got none"):
        layer.lazy_initialization(k, k)
    layer = veloxquant.CacheLayer(veloxquant.CacheConfig(SPEC), layer_idx=5)
    layer.lazy_initialization(k, k)
    assert layer._cache.layer == 5


def test_lists_of_another_length_are_refused(shipped, doc):
    # the number of layers known: build_caches' rule and message, at construction
    with pytest.raises(ValueError, match=r"\[veloxquant.Cache\] skvq_layer_bits_key: expected 3 "
                                         r"entries \(one per layer\) but got 6"):
        veloxquant.Cache(SPEC, num_layers=3)
    with pytest.raises(ValueError, match="expected 6 entries"):
        veloxquant.Cache("skvq:layer_bits_key=4/2", model_config=shipped.config)
    # made lazily: the first layer past the list is refused by the builders' resolution
    # (skvq_key_bits_of), naming the list
    cache = veloxquant.Cache("skvq:window=16:n_sink=2:layer_bits_key=4/2")
    with pytest.raises(ValueError, match=r"\[cache_config\] skvq_layer_bits_key: expected an entry "
                                         r"for layer 2 but got 2 entries \('4/2'\)"):
        with torch.no_grad():
            shipped(doc[:, :8], **kv(cache), use_cache=True)


def test_lazy_layers_take_the_index_of_their_position():
    """transformers' Cache.update(k, v, layer_idx) appends lazily made layers until layer_idx
    exists: each gets the index of the position it lands at, also when a later layer updates
    first."""
    cache = veloxquant.Cache(SPEC)
    k = torch.randn(1, H_KV, 4, D)
    cache.update(k, k, 2)  # layers 0, 1, 2 made at once
    assert [layer.layer_idx for layer in cache.layers] == [0, 1, 2]
    assert not cache.layers[0].is_initialized and cache.layers[2]._cache.layer == 2
    cache.layers[2]._pending = False
    cache.update(k, k, 4)
    assert [layer.layer_idx for layer in cache.layers] == [0, 1, 2, 3, 4]
    assert cache.layers[4]._cache.layer == 4


def test_value_bits_by_layer(shipped, doc):
    """skvq_layer_bits_value gives layer i its value bits as skvq_layer_bits_key its key bits:
    the value bytes follow the entry (token-axis values, groups of 32, fp16 (lo, scale)), the
    key bytes stay the single field's, and the refusals name the value list."""
    vbits = [2, 3, 4, 2, 8, 2]
    spec = "skvq:bits_key=2:window=16:n_sink=2:layer_bits_value=" + "/".join(map(str, vbits))
    cache = veloxquant.Cache(spec, model_config=shipped.config)
    with torch.no_grad():
        shipped(doc[:, :80], **kv(cache), use_cache=True)
    for i, (layer, bits) in enumerate(zip(cache.layers, vbits)):
        fig = layer.stats()["figures"]
        packed = int(fig["packed_rows"])
        assert packed > 0, i
        assert fig["compressed_value_bytes"] == packed * H_KV * key_row_bytes(bits), i
        assert fig["compressed_key_bytes"] == packed * H_KV * key_row_bytes(2), i
    with pytest.raises(ValueError, match=r"skvq_layer_bits_value: expected 6 entries"):
        veloxquant.Cache("skvq:layer_bits_value=4/2", model_config=shipped.config)
    with pytest.raises(ValueError, match=r"skvq_layer_bits_value '4/2'"):
        _vq.LayerCache(veloxquant.CacheConfig("skvq:layer_bits_value=4/2").to_json(), D)
