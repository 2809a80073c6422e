"""The attention function over a veloxquant cache, against an fp64 reference, per element.

Bound (the fused CPU kernel's arithmetic, as derived in tests/ops_harness/attention_bounds.cpp,
for full-precision fp32 rows; u = 2^-24, n visible keys, D = head_dim):
  * logits: D fp32 products summed in lanes plus scaling: |dl_j| <= scale (D + 8) u sum_d |q_d k_jd|;
    exp(l_j - l_max) adds u |l_j - l_max| (the rounded difference) + 2u (the kernel's exp);
    eps = max_j of these.
  * weights: logits off by <= eps move each normalised weight by a factor in [e^-2eps, e^2eps]:
    (e^{2 eps} - 1) sum_j w_j |v_jd|.
  * values: n fp32 accumulations, at most n tile rescalings, 1/l and the scale:
    (2n + 8) u sum_j w_j |v_jd|.
The fp32 output is returned as is (the model here is fp32), so no final rounding is added.
"""

import math

import pytest
import torch

from veloxquant import Cache, veloxquant_attention

U = 2.0 ** -24


def reference_and_bound(q, k, v, q_pos0, scale, window=0):
    """q [B, Hq, N, D], k/v [B, Hkv, n, D] (positions 0..n-1) -> (ref, bound) in fp64."""
    q, k, v = q.double(), k.double(), v.double()
    b, hq, n_q, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    group = hq // hkv
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    logits = torch.einsum("bhid,bhjd->bhij", q, k) * scale
    qp = torch.arange(q_pos0, q_pos0 + n_q).view(-1, 1)
    kp = torch.arange(n).view(1, -1)
    vis = kp <= qp
    if window:
        vis &= qp < kp + window
    logits = logits.masked_fill(~vis, -math.inf)
    w = torch.softmax(logits, dim=-1)
    ref = w @ v
    lmax = logits.amax(dim=-1, keepdim=True)
    abs_dot = torch.einsum("bhid,bhjd->bhij", q.abs(), k.abs()) * scale
    eps_j = (d + 8) * U * abs_dot + U * (logits - lmax).abs() + 2 * U
    eps = eps_j.masked_fill(~vis, 0).amax(dim=-1, keepdim=True)
    n_vis = vis.sum(dim=-1).view(1, 1, -1, 1).double()
    wv = w @ v.abs()
    bound = (torch.expm1(2 * eps) + (2 * n_vis + 8) * U) * wv
    return ref, bound


def step(cache, q, k, v, scale, window=0):
    key, value = cache.update(k, v, 0)
    out, _ = veloxquant_attention(None, q, key, value, None, scaling=scale,
                                  sliding_window=window or None)
    return out.transpose(1, 2)  # back to [B, Hq, N, D]


@pytest.mark.parametrize("hq, hkv, d, window", [(4, 2, 16, 0), (8, 2, 64, 0), (4, 4, 32, 0),
                                                (4, 2, 16, 9)])
def test_full_cache_attention_within_bound(hq, hkv, d, window):
    g = torch.Generator().manual_seed(hq * 100 + d + window)
    chunks = [37, 5, 1, 1, 1]  # two prefill calls, then decode steps
    total = sum(chunks)
    q = torch.randn(2, hq, total, d, generator=g) * 1.5
    k = torch.randn(2, hkv, total, d, generator=g) * 1.5
    v = torch.randn(2, hkv, total, d, generator=g)
    scale = d ** -0.5
    cache = Cache("full")
    s0 = 0
    worst = 0.0
    for n in chunks:
        got = step(cache, q[:, :, s0:s0 + n], k[:, :, s0:s0 + n], v[:, :, s0:s0 + n], scale, window)
        ref, bound = reference_and_bound(q[:, :, s0:s0 + n], k[:, :, :s0 + n], v[:, :, :s0 + n],
                                         s0, scale, window)
        assert float(ref.abs().max()) > 0
        err = (got.double() - ref).abs()
        assert bool((err <= bound).all()), f"chunk at {s0}: max err/bound {float((err / bound).max())}"
        worst = max(worst, float((err / bound).max()))
        s0 += n
    assert cache.get_seq_length() == total
    print(f"max error: {100 * worst:.1f}% of the bound")


def test_bound_catches_a_wrong_position():
    # The check can fail: attention at a query position one too far (an off-by-one in q_pos0)
    # sees one more key and leaves the bound.
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, 4, 9, 16, generator=g)
    k = torch.randn(1, 2, 9, 16, generator=g)
    v = torch.randn(1, 2, 9, 16, generator=g)
    got = step(Cache("full"), q, k, v, 0.25)
    ref, bound = reference_and_bound(q, k, v, 1, 0.25)
    assert not bool(((got.double() - ref).abs() <= bound).all())
