"""The "veloxquant" attention function, registered with transformers' AttentionInterface.

With `attn_implementation="veloxquant"` a model's attention layers call `veloxquant_attention`
after `cache.update`. When the keys come from a veloxquant.Cache layer (cache.py parks the layer
on them), the step runs in C++: the layer's update_and_fetch with the real queries, then the fused
attention of src/ops over the returned view, packed rows read in place. Without one (no cache,
or another Cache class) it falls back to transformers' SDPA attention on the tensors it was given.
The causal test uses each stored row's own position, so no mask is built for it (the function
is deliberately not registered with the mask interface: transformers then passes no mask).
Under torch.compile the step is compiled.py's attend op over the layer that the cache's update
named with its park op (a compiled graph cannot carry the Python attribute of the eager path).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from . import compiled as _compiled

NAME = "veloxquant"


def _check_dropout(dropout) -> None:
    if dropout:
        raise ValueError(f"[veloxquant.attention] dropout: expected 0 (inference) but got {dropout}")


def veloxquant_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                         sliding_window=None, **kwargs):
    """transformers attention interface: query [B, H_q, S, D], key/value [B, H_kv, S, D];
    returns ([B, S, H_q, D], None)."""
    window = sliding_window if sliding_window is not None else getattr(module, "sliding_window", 0)
    if torch.compiler.is_compiling():
        _check_dropout(dropout)
        return _compiled.attend(query, key, value, float(scaling or 0.0), int(window or 0)), None
    layer = getattr(key, "_vq_layer", None)
    if layer is None:
        n_q, n_k = query.shape[2], key.shape[2]
        if attention_mask is None and 1 < n_q < n_k:
            # No mask is built for this implementation; SDPA's is_causal would align the queries
            # top-left, so give it the bottom-right causal mask (query i sees keys <= n_k - n_q + i).
            i = torch.arange(n_q, device=query.device).view(-1, 1)
            j = torch.arange(n_k, device=query.device).view(1, -1)
            attention_mask = (j <= i + (n_k - n_q)).view(1, 1, n_q, n_k)
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, sliding_window=sliding_window, **kwargs)
    del key._vq_layer
    value = key.__dict__.pop("_vq_values", value)
    _check_dropout(dropout)
    out = layer.attend(query, key, value, scaling, int(window or 0), kwargs.get("position_ids"))
    return out, None


def register() -> None:
    """Registers "veloxquant" with transformers' AttentionInterface (done at import)."""
    AttentionInterface.register(NAME, veloxquant_attention)
