"""CUDA storage (a VQ_CUDA=ON build on a machine with a GPU; skipped elsewhere): every method's
CUDA layer against the CPU layer of the same config, through the attention function and through
generate, plus the refusals. The CPU cache is the oracle (include/veloxquant/cuda_cache.h): same
positions, selections, packed codes, state bytes and byte figures (bytes_resident excepted: on
the device it is what the cache's cudaMalloc calls hold).

Attention bound on the device (tests/ops_harness/attention_bounds.h, GPU terms): the CPU fp32
bound of test_attention_op.py (logits (D + 8) u scale sum_d |q_d k_d|, values (2n + 8) u sum w|v|)
with the CUDA kernels' extra terms: the fp16 rounding of q on the tensor-core paths adds
kGpuLogitRel scale ||q|| ||k|| to each logit (kGpuLogitRel = 2^-11 + 2^-26), the fp16 rounding of p
adds kGpuValueRel max|v| = 2^-9 max|v| to each output, and the split/tile accumulation is
2 gamma(9n/8 + 64) max|v|. We add all of them whatever kernel ran (an fp32 model gives f32 rows,
which run on the CUDA-core kernels with fp32 products, so the bound is loose there, never tight).
"""

import io
import math

import pytest
import torch
from transformers import DynamicCache

import veloxquant
from veloxquant import _veloxquant as _vq
from veloxquant import veloxquant_attention
from veloxquant.cache import CUDA_MISSING, check_device
from conftest import forced_logits, kv, tiny_llama

U = 2.0 ** -24
GPU_LOGIT_REL = 2.0 ** -11 + 2.0 ** -26
GPU_VALUE_REL = 2.0 ** -9

HAVE_CUDA = _vq.cuda_built() and torch.cuda.is_available() and _vq.cuda_available()
needs_cuda = pytest.mark.skipif(not HAVE_CUDA, reason="needs a VQ_CUDA=ON build and a CUDA device")

# Specs for head_dim 64 (the CUDA kernels take D in {64, 128}).
SPECS = {
    "full": "full",
    "snapkv": "snapkv:budget=24:obs_window=8",
    "skvq": "skvq:bits_key=4:bits_value=4:window=16:group_size=32:n_sink=2",
    "snapkv+skvq": "snapkv+skvq:budget=24:obs_window=8:bits_key=4:bits_value=4:window=8:"
                   "group_size=32:skvq_n_sink=2:snap_n_sink=2",
    "streaming": "streaming:window=20:n_sink=4",
}


def test_cpu_build_refuses_cuda_clearly():
    if _vq.cuda_built():
        pytest.skip("this build has CUDA")
    with pytest.raises(RuntimeError) as e:
        check_device(torch.device("cuda", 0))
    assert str(e.value) == CUDA_MISSING
    assert "VQ_CUDA=ON pip install ." in CUDA_MISSING


def test_other_devices_refused():
    with pytest.raises(ValueError, match="expected CPU or CUDA tensors"):
        check_device(torch.device("meta"))
    cache = veloxquant.Cache("full")
    k = torch.zeros(1, 2, 3, 16, device="meta")
    with pytest.raises(ValueError, match="expected CPU or CUDA tensors"):
        cache.update(k, k, 0)


def llama64(attn="veloxquant", dtype=torch.float32, device="cpu"):
    """conftest's tiny Llama with head_dim 64 (hidden 64, 4 heads, 2 KV heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, head_dim=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1024, attn_implementation=attn)
    cfg.initializer_range = 0.2
    model = LlamaForCausalLM(cfg).to(dtype).eval().to(device)
    model.generation_config.eos_token_id = None
    return model


def step(cache, q, k, v, scale):
    key, value = cache.update(k, v, 0)
    out, _ = veloxquant_attention(None, q, key, value, None, scaling=scale)
    return out.transpose(1, 2)


def gpu_bound(q, k, v, q_pos0, scale):
    """fp64 reference and the GPU bound above; q [B, Hq, N, D], k/v [B, Hkv, n, D] at 0..n-1."""
    q, k, v = q.double().cpu(), k.double().cpu(), v.double().cpu()
    b, hq, n_q, d = q.shape
    g = hq // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    n = k.shape[2]
    logits = torch.einsum("bhid,bhjd->bhij", q, k) * scale
    vis = torch.arange(n).view(1, -1) <= torch.arange(q_pos0, q_pos0 + n_q).view(-1, 1)
    logits = logits.masked_fill(~vis, -math.inf)
    w = torch.softmax(logits, -1)
    lmax = logits.amax(-1, keepdim=True)
    abs_dot = torch.einsum("bhid,bhjd->bhij", q.abs(), k.abs()) * scale
    norms = q.norm(dim=-1).unsqueeze(-1) * k.norm(dim=-1).unsqueeze(-2) * scale
    eps_j = (d + 8) * U * abs_dot + GPU_LOGIT_REL * norms + U * (logits - lmax).abs() + 2 * U
    eps = eps_j.masked_fill(~vis, 0).amax(-1, keepdim=True)
    n_vis = vis.sum(-1).view(1, 1, -1, 1).double()
    vmax = (vis.double().unsqueeze(-1) * v.abs().unsqueeze(2)).amax(-2)  # [B, Hq, N, D]
    bound = (torch.expm1(2 * eps) + (2 * n_vis + 8) * U) * (w @ v.abs()) \
        + (GPU_VALUE_REL + 2 * (9 * n_vis / 8 + 64) * U) * vmax
    return w @ v, bound


def figures(stats):
    return [{k: v for k, v in st.items() if k != "bytes_resident"} for st in stats]


@needs_cuda
@pytest.mark.parametrize("method", list(SPECS))
def test_layer_matches_cpu_layer(method):
    """The same blocks (prefill of 40 in two calls, then 10 decode steps) into a CPU and a CUDA
    cache: the same positions, state bytes and figures; outputs within the GPU bound of the
    fp64 reference for the full method; the methods keeping full-precision rows close to the CPU's
outputs (the packed ones: their codes are compared through the state bytes; the CPU's packed
kernels round the query to int8, a bound this file does not restate)."""
    g = torch.Generator().manual_seed(7)
    b, hq, hkv, d, n = 1, 4, 2, 64, 50
    q = torch.randn(b, hq, n, d, generator=g)
    k = torch.randn(b, hkv, n, d, generator=g)
    v = torch.randn(b, hkv, n, d, generator=g)
    scale = d ** -0.5
    cpu, dev = veloxquant.Cache(SPECS[method]), veloxquant.Cache(SPECS[method])
    worst, worst_cpu = 0.0, 0.0
    for s0, s1 in [(0, 25), (25, 40)] + [(t, t + 1) for t in range(40, n)]:
        o_cpu = step(cpu, q[:, :, s0:s1], k[:, :, s0:s1], v[:, :, s0:s1], scale)
        o_dev = step(dev, q[:, :, s0:s1].cuda(), k[:, :, s0:s1].cuda(), v[:, :, s0:s1].cuda(),
                     scale).cpu()
        if method == "full":
            ref, bound = gpu_bound(q[:, :, s0:s1], k[:, :, :s1], v[:, :, :s1], s0, scale)
            err = (o_dev.double() - ref).abs()
            assert bool((err <= bound).all()), f"step {s0}: {float((err - bound).max()):.3g}"
            worst = max(worst, float((err / bound).max()))
        if "skvq" not in method:
            # Full-precision rows on both sides: each output within (2n + 8) u sum w|v| plus the
            # GPU terms (< 3e-3 |v| here, n <= 50, |v| < 5) of the exact one.
            diff = float((o_dev - o_cpu).abs().max())
            worst_cpu = max(worst_cpu, diff)
            assert diff < 1e-2, f"step {s0}: CPU vs CUDA {diff:.3g}"
    print(f"\n{method}: worst err/bound {worst:.3g}, max |CUDA - CPU| {worst_cpu:.3g}")
    for h in range(hkv):
        assert dev.layers[0].stored_positions(0, h) == cpu.layers[0].stored_positions(0, h)
    assert figures(dev.stats()) == figures(cpu.stats())
    assert dev.stats()[0]["bytes_resident"] > 0
    a, c = io.BytesIO(), io.BytesIO()
    dev.save(a)
    cpu.save(c)
    assert a.getvalue() == c.getvalue()
    # Round trip: the CUDA state into a fresh CUDA cache and a CPU cache; both continue.
    back = veloxquant.Cache(SPECS[method])
    back.load(io.BytesIO(a.getvalue()), device="cuda")
    assert back.layers[0].device.type == "cuda" and back.get_seq_length() == n
    on_cpu = veloxquant.Cache(SPECS[method])
    on_cpu.load(io.BytesIO(a.getvalue()))
    qn, kn, vn = (torch.randn(b, h_, 1, d, generator=g) for h_ in (hq, hkv, hkv))
    o1 = step(dev, qn.cuda(), kn.cuda(), vn.cuda(), scale).cpu()
    o2 = step(back, qn.cuda(), kn.cuda(), vn.cuda(), scale).cpu()
    o3 = step(on_cpu, qn, kn, vn, scale)
    print(f"{method}: loaded CUDA state continues, bit-identical {torch.equal(o1, o2)}, "
          f"max diff {float((o1 - o2).abs().max()):.3g}")
    assert float((o1 - o2).abs().max()) <= 1e-5
    if "skvq" not in method:
        assert float((o1 - o3).abs().max()) < 1e-2


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("method", ["full", "skvq", "snapkv"])
def test_decode_in_model_dtype(method, dtype):
    """A decode step takes the query in the model's dtype as transformers hands it (the
    [B, H_q, 1, D] transpose of a [B, 1, H_q, D] tensor) and returns the output in that dtype,
    both converted on the device (cuda::decode_attention_typed). Widening the query is exact and
    the kernels are deterministic, so the output is bit for bit the float32 query's output
    rounded once to the dtype."""
    g = torch.Generator().manual_seed(11)
    b, hq, hkv, d, n = 2, 8, 2, 64, 24
    typed, wide = veloxquant.Cache(SPECS[method]), veloxquant.Cache(SPECS[method])
    k = torch.randn(b, hkv, n, d, generator=g).to(dtype).cuda()
    v = torch.randn(b, hkv, n, d, generator=g).to(dtype).cuda()
    q = torch.randn(b, n, hq, d, generator=g).to(dtype).cuda().transpose(1, 2)  # [B, Hq, n, D]
    p = 16  # a prefill of 16 (the float32 route), then decode steps
    for s0, s1 in [(0, p)] + [(t, t + 1) for t in range(p, n)]:
        o_typed = step(typed, q[:, :, s0:s1], k[:, :, s0:s1], v[:, :, s0:s1], 0.125)
        o_wide = step(wide, q[:, :, s0:s1].float(), k[:, :, s0:s1], v[:, :, s0:s1], 0.125)
        assert o_typed.dtype == dtype and o_typed.shape == (b, hq, s1 - s0, d)
        if s1 - s0 == 1:
            assert o_wide.dtype == torch.float32
            assert torch.equal(o_typed, o_wide.to(dtype)), f"step {s0}"
    assert typed.get_seq_length() == n


@needs_cuda
@pytest.mark.parametrize("method", list(SPECS))
def test_generate_matches_cpu(method):
    """generate on the tiny Llama (head_dim 64): the CUDA cache has the CPU cache's byte figures
    and gives its tokens (full: DynamicCache's too).

    The SKVQ methods' greedy tokens are not a stable oracle on this random model: on the H200
    (docs/results/gpu/python/test_cuda.log) CUDA and the host's CPU agreed on the first 5
    (skvq) and 3 (snapkv+skvq) of 24 tokens, and CPU runs differ among themselves as much: with
    the same weights, the CPU kernels that round the query to int8 (AVX-512 VNNI, packed_decode.h)
    reproduce the host's snapkv+skvq tokens while the exact CPU kernels (avx512, portable)
    reproduce CUDA's all 24; for skvq the exact CPU kernels of a -march=native build agree with
    CUDA on 9 tokens and the host's wheel build on 5. So for them a mismatch is reported as an
    expected failure, with the first differing token; the layer test above compares their codes
    (state bytes) exactly."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (1, 70), generator=g)
    # eager decode steps: the kernels against the CPU's (the compiled path, which generate takes
    # on CUDA for our compileable cache, is test_compiled_cuda_graph_steps_reach_the_cache's)
    args = dict(max_new_tokens=24, do_sample=False, pad_token_id=0, disable_compile=True)
    cpu_cache, dev_cache = veloxquant.Cache(SPECS[method]), veloxquant.Cache(SPECS[method])
    ref = llama64().generate(ids, **kv(cpu_cache), **args)
    got = llama64(device="cuda").generate(ids.cuda(), **kv(dev_cache), **args).cpu()
    assert figures(dev_cache.stats()) == figures(cpu_cache.stats())
    for layer in dev_cache.layers:
        assert layer.device.type == "cuda"
    same = torch.equal(got, ref)
    first = None if same else int((got != ref).nonzero()[0, 1]) - ids.shape[1]
    print(f"\n{method}: tokens equal {same} (first differing generated token: {first})")
    if "skvq" in method and not same:
        pytest.xfail(f"greedy tokens of the SKVQ methods differ from generated token {first} on "
                     "(kernel roundings; see the docstring)")
    assert same
    if method == "full":
        dyn = llama64("sdpa", device="cuda").generate(ids.cuda(), **kv(DynamicCache()), **args)
        assert torch.equal(got, dyn.cpu())


@needs_cuda
def test_full_logits_within_fp32_bound():
    """Teacher-forced logits of the full method on CUDA against an fp64 CPU run: an fp32 model
    gives f32 rows, which the CUDA-core kernels read with fp32 products and accumulation, so the
    error has the form of transformers' own fp32 paths (test_generate.py's argument): at most
    twice the larger of transformers' eager and SDPA errors on the same device."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (1, 70), generator=g)
    l64 = forced_logits(llama64("eager", torch.float64), ids, DynamicCache(), 40, 25)
    l_vq = forced_logits(llama64(device="cuda"), ids.cuda(), veloxquant.Cache("full"), 40, 25)
    e_ref = max(float((forced_logits(llama64(a, device="cuda"), ids.cuda(), DynamicCache(), 40,
                                     25).double().cpu() - l64).abs().max())
                for a in ("eager", "sdpa"))
    e_vq = float((l_vq.double().cpu() - l64).abs().max())
    print(f"\nfull logits: ours {e_vq:.3g}, transformers' fp32 {e_ref:.3g}")
    assert 0 < e_ref < 1e-3
    assert e_vq <= 2 * e_ref


@needs_cuda
def test_refusals():
    # head_dim 16: the library's message, and nothing stored.
    small = tiny_llama().cuda()
    cache = veloxquant.Cache("full")
    with pytest.raises(ValueError, match=r"head_dim in \{64, 128\}"):
        small(torch.tensor([[5, 6, 7]], device="cuda"), **kv(cache), use_cache=True)
    assert cache.layers[0]._cache.stored_rows == 0 and cache.get_seq_length() == 0
    # Devices mixed between steps.
    q, k = torch.randn(1, 4, 3, 64), torch.randn(1, 2, 3, 64)
    cpu_first = veloxquant.Cache("full")
    step(cpu_first, q, k, k, 0.125)
    with pytest.raises(ValueError, match="one device"):
        step(cpu_first, q.cuda(), k.cuda(), k.cuda(), 0.125)
    dev_first = veloxquant.Cache("full")
    step(dev_first, q.cuda(), k.cuda(), k.cuda(), 0.125)
    with pytest.raises(ValueError, match="one device"):
        step(dev_first, q, k, k, 0.125)
    assert dev_first.get_seq_length() == 3
    # Unsupported dtype: float64 rows.
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        step(veloxquant.Cache("full"), q.cuda().double(), k.cuda().double(), k.cuda().double(),
             0.125)


@needs_cuda
def test_compiled_cuda_graph_steps_reach_the_cache():
    """Decode steps through torch.compile with inductor in CUDA-graph mode (what transformers'
    generate uses; compiled.py), for full, skvq and snapkv+skvq through one compiled forward:
    the cache's custom ops run between the graphs at every step, so the cache ends with the
    eager run's figures (rows, tokens, bytes: a replayed graph that had captured the step would
    leave them at the first step's), and the greedy choice of every teacher-forced step is the
    eager one's. Inductor fuses the rest of the model differently from eager torch, so logits
    differ by fp32 roundings and the rows stored can differ in their last bits: the comparison
    is of figures and greedy choices (this model's top-2 logit gaps are far above such
    roundings), not of bytes."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (1, 56), generator=g).cuda()
    model = llama64(device="cuda")
    torch._dynamo.reset()
    fwd = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)

    def run(forward, cache):
        with torch.no_grad():
            model(ids[:, :40], **kv(cache), use_cache=True)
            picks = []
            for t in range(40, ids.shape[1]):
                pos = torch.tensor([[t]], device="cuda")
                out = forward(input_ids=ids[:, t:t + 1], position_ids=pos, **kv(cache),
                              use_cache=True)
                picks.append(int(out.logits[0, -1].argmax()))
        return picks

    for method in ("full", "skvq", "snapkv+skvq"):
        eager_cache, comp_cache = veloxquant.Cache(SPECS[method]), veloxquant.Cache(SPECS[method])
        ref = run(model.forward, eager_cache)
        got = run(fwd, comp_cache)
        assert figures(comp_cache.stats()) == figures(eager_cache.stats()), method
        assert got == ref, method
