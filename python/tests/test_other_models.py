"""Mistral (sliding-window attention) and Qwen2 (q/k/v biases) through the same cache and
attention function: tiny random models, the full method giving DynamicCache's greedy tokens
(the sliding window is applied by our attention from each row's position), and a packed
method generating."""

import pytest
import torch
from transformers import DynamicCache, MistralConfig, MistralForCausalLM, Qwen2Config, \
    Qwen2ForCausalLM

import veloxquant
from conftest import kv


def tiny(kind, attn):
    torch.manual_seed(0)
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  initializer_range=0.2, attn_implementation=attn)
    if kind == "mistral":
        model = MistralForCausalLM(MistralConfig(sliding_window=16, **common))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    model.generation_config.eos_token_id = None
    return model.eval()


@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
def test_full_matches_dynamic_cache_and_packed_generates(kind, prompt):
    ref = tiny(kind, "eager").generate(prompt, **kv(DynamicCache()), max_new_tokens=16,
                                       do_sample=False, pad_token_id=0)
    model = tiny(kind, "veloxquant")
    got = model.generate(prompt, **kv(veloxquant.Cache("full")), max_new_tokens=16,
                         do_sample=False, pad_token_id=0)
    assert torch.equal(got, ref)
    cache = veloxquant.Cache("skvq:bits_key=4:bits_value=4:window=16:group_size=8:n_sink=2")
    out = model.generate(prompt, **kv(cache), max_new_tokens=16, do_sample=False, pad_token_id=0)
    assert out.shape == ref.shape and cache.memory()["ratio_to_fp16"] < 1.0
