"""torch.compile over a veloxquant.Cache (compiled.py): compiled decode steps give the eager steps'
logits exactly, for every method, and transformers' generate compiles with our cache.

The compiled graphs here use the "aot_eager" backend (dynamo tracing and the custom ops'
functionalisation, no code generation: seconds on CI's cores instead of minutes); the ops run
the same C++ step as the eager path, and the rest of the model is the same torch kernels in the
same order, so the logits must be equal bit for bit, not within a bound. Inductor with CUDA
graphs is what the GPU benchmark runs (tools/bench_python_cache.py, vqc: caches)."""

import pytest
import torch

import veloxquant
from conftest import kv, tiny_llama
from test_generate import SPECS

N_PREFILL, N_DECODE = 40, 12


@torch.no_grad()
def decode_logits(model, forward, prompt, cache):
    """Eager prefill of N_PREFILL tokens, then N_DECODE teacher-forced steps through `forward`
    (with their positions, as generate passes them: the cache's token count is host state that
    a compiled graph does not read)."""
    model(prompt[:, :N_PREFILL], **kv(cache), use_cache=True)
    out = []
    for t in range(N_PREFILL, N_PREFILL + N_DECODE):
        pos = torch.tensor([[t]])
        out.append(forward(input_ids=prompt[:, t:t + 1], position_ids=pos, **kv(cache),
                           use_cache=True).logits)
    return torch.cat(out, dim=1)


@pytest.fixture(scope="module")
def compiled_forward(model):
    torch._dynamo.reset()
    return torch.compile(model.forward, backend="aot_eager", fullgraph=True)


@pytest.mark.parametrize("method", list(SPECS))
def test_compiled_decode_equals_eager(model, prompt, compiled_forward, method):
    eager = decode_logits(model, model.forward, prompt, veloxquant.Cache(SPECS[method]))
    cache = veloxquant.Cache(SPECS[method])
    got = decode_logits(model, compiled_forward, prompt, cache)
    assert torch.equal(got, eager)
    n_seen = N_PREFILL + N_DECODE
    assert cache.get_seq_length() == n_seen
    assert all(st["tokens_seen"] == n_seen for st in cache.stats())


def test_a_second_cache_reuses_the_graph(model, prompt, compiled_forward):
    """Two caches in turn through one compiled forward: each step reaches its own cache (the
    park op's token is a graph input, not a constant), and the graph is not traced again."""
    from torch._dynamo.utils import counters
    spec = SPECS["skvq"]
    ref_b = decode_logits(model, model.forward, prompt[:, 5:], veloxquant.Cache(spec))
    a, b = veloxquant.Cache(spec), veloxquant.Cache(spec)
    decode_logits(model, compiled_forward, prompt, a)  # traces (or reuses) the graph
    before = counters["stats"]["unique_graphs"]
    got_b = decode_logits(model, compiled_forward, prompt[:, 5:], b)
    assert counters["stats"]["unique_graphs"] == before
    assert torch.equal(got_b, ref_b)
    assert a.get_seq_length() == b.get_seq_length() == N_PREFILL + N_DECODE
    assert [st["tokens_seen"] for st in a.stats()] == [N_PREFILL + N_DECODE] * 2


def test_generate_compiles_with_our_cache(prompt):
    """transformers' generate takes the compiled path for a compileable cache
    (compile_config, forced on the CPU); its tokens equal the eager generate's."""
    from transformers import CompileConfig
    model = tiny_llama()
    spec = SPECS["snapkv+skvq"]
    eager = model.generate(prompt, **kv(veloxquant.Cache(spec)), max_new_tokens=10,
                           do_sample=False, pad_token_id=0, disable_compile=True)
    cfg = CompileConfig(backend="aot_eager", fullgraph=True)
    cfg._compile_all_devices = True
    torch._dynamo.reset()
    got = model.generate(prompt, **kv(veloxquant.Cache(spec)), max_new_tokens=10,
                         do_sample=False, pad_token_id=0, compile_config=cfg)
    assert hasattr(model, "_compiled_call")  # generate did take the compiled path
    assert torch.equal(got, eager)


def test_compiled_step_without_our_cache_is_refused(prompt):
    """attn_implementation='veloxquant' compiled over another cache: a clear error, not a step
    over some other cache's rows."""
    from transformers import StaticCache
    model = tiny_llama()
    cache = StaticCache(config=model.config, max_cache_len=64)
    fwd = torch.compile(model.forward, backend="aot_eager", fullgraph=True)
    with pytest.raises(RuntimeError, match="expected the keys of a veloxquant.Cache"):
        with torch.no_grad():
            fwd(input_ids=prompt[:, :1], **kv(cache), use_cache=True)
