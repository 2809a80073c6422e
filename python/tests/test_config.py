"""Specs, config objects and refusals: the Python side parses with the CLI's parser
(src/core/cache_config.cpp), and a refusal is a ValueError carrying the library's message."""

import pytest

import veloxquant
from veloxquant import Cache, CacheConfig


def test_methods():
    assert veloxquant.methods() == ["full", "snapkv", "skvq", "snapkv+skvq", "streaming"]


def test_spec_sets_fields():
    c = CacheConfig("snapkv+skvq:budget=256:bits_key=4:bits_value=4")
    assert c.method == "snapkv+skvq"
    assert c["snap_budget"] == 256
    assert c["skvq_bits_key"] == 4.0 and c["skvq_bits_value"] == 4.0
    assert c["skvq_group_size"] == 32  # untouched fields keep the seed defaults
    assert "head_dim" not in c.to_dict()  # set per layer from the model's tensors


def test_spec_dict_and_keywords_agree():
    a = CacheConfig("skvq:bits_key=4:bits_value=2:group_size=16")
    b = CacheConfig({"method": "skvq", "skvq_bits_key": 4, "skvq_bits_value": 2,
                     "skvq_group_size": 16})
    c = CacheConfig(method="skvq", bits_key=4, bits_value=2, group_size=16)
    d = CacheConfig("skvq", bits_key=4, bits_value=2, group_size=16)
    assert a == b == c == d
    assert CacheConfig(a) == a
    assert Cache(a.to_dict()).cache_config == a


@pytest.mark.parametrize("spec, message", [
    ("nope", "nope"),
    ("snapkv:budget=0", "[cache_config] snap_budget: expected >= 1 but got 0"),
    ("skvq:bits_key=9", "skvq_bits_key"),
    ("snapkv:bits_key=4", "bits_key"),      # a key of another method
    ("snapkv+skvq:n_sink=2", "n_sink"),     # ambiguous short name
    ("snapkv:budget=4:n_sink=4", "snap_n_sink"),  # sinks fill the budget: nothing scored
    ("skvq:window=abc", "skvq_window"),
])
def test_bad_specs_raise_value_error(spec, message):
    with pytest.raises(ValueError) as e:
        CacheConfig(spec)
    assert message in str(e.value)
    with pytest.raises(ValueError):
        Cache(spec)


def test_bad_dict_and_type():
    with pytest.raises(ValueError, match="snap_budget"):
        CacheConfig({"method": "snapkv", "snap_budget": -3})
    with pytest.raises(ValueError, match="expected a spec string"):
        CacheConfig(42)
    with pytest.raises(ValueError, match="without ':'"):
        CacheConfig("skvq", perm_file="a:b")
