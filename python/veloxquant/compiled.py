"""torch.compile support: a step of a veloxquant.Cache layer as two torch custom ops.

Under torch.compile (transformers' `generate` compiles the decode steps of a cache whose
`is_compileable` is true, in CUDA-graph mode by default) the eager path of cache.py and
attention.py cannot run: it parks the new rows on the key tensor as a Python attribute and calls
the C++ layer directly, neither of which a traced graph can hold. Two custom ops stand in:

  veloxquant::park(key, token) -> key'     in CacheLayer.update: names the layer of this step
                                          (token: a CPU int64 tensor holding the layer's slot in
                                          the registry below) and returns a copy of the step's
                                          keys, so the attention op depends on it and runs after;
  veloxquant::attend(q, k, v, scale, window) -> out [B, S, H_q, D]
                                          in the attention function: the parked layer's C++
                                          update_and_fetch + fused attention (CacheLayer.attend).

Both run eagerly between the compiled pieces and are tagged cudagraph-unsafe (where torch has
the tag), so inductor's graph partition captures everything else of the step in CUDA graphs and
calls these two on the stream between replays: the cache's host-side state (row counts, the SKVQ
frontier, SnapKV's selection) advances at every step, as in eager mode. The token is a tensor,
not a Python int, so a new Cache reuses the compiled graph instead of recompiling (tensors are
graph inputs guarded by shape and dtype, ints are specialised). The copy `park` returns is one
step's keys ([B, H_kv, S, D]: 8 KiB per layer for Llama-3-8B's decode at batch 1).
"""

from __future__ import annotations

import weakref

import torch

_LAYERS: dict = {}  # slot -> weakref to its CacheLayer
_NEXT_SLOT = [0]
_PARKED: list = [None]  # the layer named by the last park, consumed by the next attend

_TAGS = (torch._C.Tag.cudagraph_unsafe,) if hasattr(torch._C.Tag, "cudagraph_unsafe") else ()


def register_layer(layer) -> torch.Tensor:
    """A new slot for `layer`; returns its token (CPU int64 [1])."""
    slot = _NEXT_SLOT[0]
    _NEXT_SLOT[0] += 1
    _LAYERS[slot] = weakref.ref(layer, lambda _ref, s=slot: _LAYERS.pop(s, None))
    return torch.tensor([slot], dtype=torch.int64)


def _custom_op(name, mutates_args=()):
    try:
        return torch.library.custom_op(name, mutates_args=mutates_args, tags=_TAGS or None)
    except TypeError:  # torch without custom_op(tags=...)
        return torch.library.custom_op(name, mutates_args=mutates_args)


@_custom_op("veloxquant::park")
def park(key: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    ref = _LAYERS.get(int(token[0]))
    layer = ref() if ref is not None else None
    if layer is None:
        raise RuntimeError("[veloxquant.Cache] compiled step: expected a live cache layer for "
                           f"slot {int(token[0])} but it was released")
    _PARKED[0] = layer
    return key.clone()


@park.register_fake
def _park_fake(key, token):
    return torch.empty_like(key)


@_custom_op("veloxquant::attend")
def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
           window: int) -> torch.Tensor:
    layer = _PARKED[0]
    _PARKED[0] = None
    if layer is None:
        raise RuntimeError(
            "[veloxquant.attention] compiled step: expected the keys of a veloxquant.Cache "
            "layer's update but got none: pass past_key_values=veloxquant.Cache(...) with "
            "attn_implementation='veloxquant'")
    return layer.attend(query, key, value, scaling, window, None)


@attend.register_fake
def _attend_fake(query, key, value, scaling, window):
    b, hq, s, d = query.shape
    return query.new_empty((b, s, hq, d))
