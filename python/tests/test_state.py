"""State files from Python: a saved cache continues bit-identically after load, and a truncated,
corrupted or mismatched file is refused (RuntimeError with the library's message) with every
layer left as it was (docs/design.md §C1 state)."""

import io

import pytest
import torch

import veloxquant
from conftest import forced_logits

SPECS = ["full", "snapkv:budget=24:obs_window=8",
         "skvq:bits_key=4:bits_value=2:window=16:group_size=8:n_sink=2",
         "snapkv+skvq:budget=24:obs_window=8:window=8:group_size=8:skvq_n_sink=2:snap_n_sink=2",
         "streaming:window=20:n_sink=4"]


@pytest.mark.parametrize("spec", SPECS)
def test_round_trip_continues_bit_identically(model, prompt, spec, tmp_path):
    a = veloxquant.Cache(spec)
    forced_logits(model, prompt[:, :50], a, 50)
    path = tmp_path / "cache.vq"
    a.save(path)
    b = veloxquant.Cache(spec)
    b.load(path)
    assert b.get_seq_length() == a.get_seq_length() == 50
    for x, y in zip(a.stats(), b.stats()):
        assert x["bytes_accounted"] == y["bytes_accounted"] and x["figures"] == y["figures"]
    la = forced_logits(model, prompt, a, 50)[:, -20:]
    lb = forced_logits(model, prompt, b, 50)[:, -20:]
    assert torch.equal(la, lb)


def test_corrupted_and_mismatched_files_refused(model, prompt):
    spec = SPECS[2]
    a = veloxquant.Cache(spec)
    forced_logits(model, prompt[:, :40], a, 40)
    buf = io.BytesIO()
    a.save(buf)
    data = buf.getvalue()

    target = veloxquant.Cache(spec)
    forced_logits(model, prompt[:, :30], target, 30)
    before = target.stats()

    bad_byte = bytearray(data)
    bad_byte[-10] ^= 0x40  # inside the last layer's checksummed state
    cases = {
        "truncated": data[:-7],
        "corrupted": bytes(bad_byte),
        "not a state": b"hello" * 10,
        "trailing": data + b"x",
    }
    for what, blob in cases.items():
        with pytest.raises(RuntimeError) as e:
            target.load(io.BytesIO(blob))
        assert "expected" in str(e.value), what
        assert target.stats() == before, what  # all or nothing: nothing changed

    other = veloxquant.Cache("skvq:bits_key=4:bits_value=4:window=16:group_size=8:n_sink=2")
    with pytest.raises(RuntimeError, match="config"):
        other.load(io.BytesIO(data))


def test_save_before_any_step_refused():
    with pytest.raises(RuntimeError, match="save"):
        veloxquant.Cache("full", num_layers=2).save(io.BytesIO())
