"""veloxquant.Cache: a transformers Cache whose layers hold a veloxquant method's packed storage.

Each layer (CacheLayer) owns one C++ cache on the device of the tensors of its first step: a CPU
cache (include/veloxquant/cache.h) or a CUDA one (include/veloxquant/cuda_cache.h, when built
with VQ_CUDA=ON), whose steps run on torch's current CUDA stream. transformers calls
`update(k, v)` before the attention function, but SnapKV's query scoring needs the step's queries
and our attention reads the compressed rows in place, so `update` only parks the new rows on the
returned key tensor; the "veloxquant" attention function (attention.py) then hands keys, values
and the real queries to the C++ layer in one call (update_and_fetch + fused attention over the
CacheView: no dequantized copy of the cache). Keys arrive already rotated by RoPE at their true
positions; eviction keeps rotated keys with their positions, and `get_seq_length` is the true
position of the next token (docs/design.md §C1), so RoPE of later tokens is unaffected by eviction.

State files: one file per Cache, a small header (magic, version, config JSON, layer count) then
each layer's checksummed C++ state (binary_io.h); loading is all-or-nothing over every layer.
"""

from __future__ import annotations

import io
import json
import struct
from typing import Any, Mapping

import torch
from transformers.cache_utils import Cache as _HFCache
from transformers.cache_utils import CacheLayerMixin

from . import _veloxquant as _vq
from . import compiled as _compiled
from .config import CacheConfig

_MAGIC = b"VQPYCACH"
_VERSION = 1


CUDA_MISSING = ("[veloxquant.Cache] this veloxquant was built without CUDA: reinstall with "
                "VQ_CUDA=ON pip install .")


def check_device(device: torch.device) -> None:
    """Refuses (RuntimeError / ValueError) a device this build cannot hold storage on."""
    if device.type == "cuda":
        if not _vq.cuda_built():
            raise RuntimeError(CUDA_MISSING)
    elif device.type != "cpu":
        raise ValueError(f"[veloxquant.Cache] expected CPU or CUDA tensors but got {device}")


def tp_kv_heads(model_config: Any) -> tuple:
    """(kv_head_first, kv_heads_total) of this process under transformers' tensor parallelism
    (tp_plan: k_proj / v_proj split by output rows, so rank r of W holds KV heads
    [r H / W, (r + 1) H / W) of H): what a rank's Cache needs for exact Hadamard signs and
    calibrated permutation files (CacheConfig::kv_head_first, include/veloxquant/cache_config.h).
    (0, 0), not sharded, outside an initialised torch.distributed or with one process."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return (0, 0)
    world, rank = dist.get_world_size(), dist.get_rank()
    total = int(getattr(model_config, "num_key_value_heads", None)
                or model_config.num_attention_heads)
    if total % world:
        raise ValueError(f"[veloxquant.Cache] tensor parallelism: expected the world size to divide "
                         f"the model's {total} KV heads but got {world} processes")
    return (rank * total // world, total)


def _new_storage(config: CacheConfig, head_dim: int, device: torch.device, batch: int,
                 n_kv_heads: int, kv_heads: tuple = (0, 0), layer: int | None = None):
    """The C++ layer for `device`: LayerCache (CPU; B and H_kv taken at its first step) or
    DeviceLayerCache (CUDA: B, H_kv and D fixed now, on torch's current stream of `device`).
    kv_heads: (kv_head_first, kv_heads_total), the layer's heads this cache holds. layer: the
    model layer it serves (its entries of skvq_layer_bits_key / skvq_layer_key_rows /
    skvq_layer_bits_value and of skvq_perm_file, as the C++ builders give them); None refuses the
    per-layer lists."""
    if device.type == "cpu":
        return _vq.LayerCache(config.to_json(), head_dim, *kv_heads, layer=layer)
    check_device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    with torch.cuda.device(index):
        stream = torch.cuda.current_stream().cuda_stream
        return _vq.DeviceLayerCache(config.to_json(), head_dim, batch, n_kv_heads, stream, index,
                                    *kv_heads, layer=layer)


class CacheLayer(CacheLayerMixin):
    """One model layer's veloxquant cache (transformers' per-layer cache object). layer_idx: the
    model layer it serves (Cache gives each of its layers its index), which picks its entries of
    the per-layer lists; None (a layer made by hand) refuses those lists at the first update."""

    # Decode steps compile (compiled.py: the C++ step as custom ops that run between the
    # compiled pieces); prefill runs eagerly, as transformers' generate does.
    is_compileable = True
    is_croppable = False
    is_sliding = False

    def __init__(self, config: CacheConfig, kv_heads: tuple = (0, 0),
                 layer_idx: int | None = None):
        super().__init__()
        self.config = config
        self.kv_heads = (int(kv_heads[0]), int(kv_heads[1]))  # (kv_head_first, kv_heads_total)
        self.layer_idx = None if layer_idx is None else int(layer_idx)
        self._cache: Any = None  # _veloxquant.LayerCache, created at the first update
        self._pending = False
        self.head_dim = 0
        self._token = _compiled.register_layer(self)  # the compiled step's handle (compiled.py)

    # -- transformers' layer protocol -------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        device = key_states.device
        check_device(device)
        b, h, _, d = key_states.shape
        self.head_dim = int(d)
        self._cache = _new_storage(self.config, self.head_dim, device, int(b), int(h),
                                   self.kv_heads, self.layer_idx)
        self.device = device
        self.dtype = key_states.dtype
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if torch.compiler.is_compiling():
            # A compiled step: the layer was made by an eager step before (transformers' generate
            # prefills eagerly); the park op names it for the attention op (compiled.py).
            if not self.is_initialized:
                raise RuntimeError("[veloxquant.Cache] compiled step: expected an eager first "
                                   "step (the prefill) before a compiled one")
            return _compiled.park(key_states, self._token), value_states
        if self._pending:
            self._pending = False
            raise RuntimeError(
                "[veloxquant.Cache] expected the previous step's attention to run through "
                "attn_implementation='veloxquant' but it did not: load the model with "
                "attn_implementation='veloxquant' (import veloxquant registers it)"
            )
        if value_states.device != key_states.device:
            raise ValueError(f"[veloxquant.Cache] values: expected the keys' device "
                             f"{key_states.device} but got {value_states.device}")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)  # checks the device
        elif key_states.device != self.device:
            raise ValueError(
                f"[veloxquant.Cache] expected tensors on {self.device} (where this layer's "
                f"storage lives since its first step) but got {key_states.device}: "
                "every step of one cache runs on one device"
            )
        # The rows enter the cache in the attention function, with the queries (attention.py).
        key_states._vq_layer = self
        key_states._vq_values = value_states
        self._pending = True
        return key_states, value_states

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: float | None, window: int, position_ids: torch.Tensor | None):
        """One attention step over the stored rows and this call's: [B, S, H_q, D] output,
        contiguous (the strides a fresh tensor of that shape has: compiled.py's fake says so)."""
        self._pending = False
        b, hq, s, d = query.shape
        offset = self._cache.offset
        # The check reads the positions back to the host (a device sync on CUDA): once per step,
        # not once per layer. Every layer of a step gets the same position_ids tensor at the same
        # offset, so the first layer marks it checked for (offset, s) and the others skip.
        if position_ids is not None and getattr(position_ids, "_vq_checked", None) != (offset, s):
            expected = torch.arange(offset, offset + s, device=position_ids.device)
            if not bool((position_ids == expected).all()):
                raise ValueError(
                    "[veloxquant.Cache] expected positions "
                    f"{offset}..{offset + s - 1} for every sequence of the batch but got "
                    f"{position_ids.tolist() if position_ids.numel() <= 16 else 'others'}: "
                    "padded batches (per-sequence positions) are not supported"
                )
            position_ids._vq_checked = (offset, s)
        # Inference only: the C++ step is outside autograd (detach: DLPack refuses grad tensors).
        pass_queries = self.config.method.startswith("snapkv")
        scale, window = float(scaling or 0.0), int(window or 0)
        if self.device.type == "cuda" and s == 1:
            # A decode step: the query goes in its own dtype and strides and the output comes back
            # in it, converted on the device (cuda::decode_attention_typed), on torch's current
            # stream of the tensors' device (the stream the layer was made on): no copies made
            # here, no synchronisation. With S = 1, [B, 1, H_q, D] and [B, H_q, 1, D] are the same
            # contiguous bytes: the C++ side writes the latter, the caller gets the former.
            out = torch.empty((b, 1, hq, d), dtype=query.dtype, device=query.device)
            self._cache.attend(key.detach(), value.detach(), query.detach(), out.view(b, hq, 1, d),
                               scale, window, pass_queries,
                               torch.cuda.current_stream(self.device).cuda_stream)
            return out
        q32 = query.detach().to(torch.float32).contiguous()
        out = torch.empty((b, hq, s, d), dtype=torch.float32, device=query.device)
        args = (key.detach(), value.detach(), q32, out, scale, window, pass_queries)
        if self.device.type == "cuda":
            self._cache.attend(*args, torch.cuda.current_stream(self.device).cuda_stream)
        else:
            self._cache.attend(*args)
        res = torch.empty((b, s, hq, d), dtype=query.dtype, device=query.device)
        res.copy_(out.transpose(1, 2))
        return res

    def get_seq_length(self) -> int:
        """Tokens seen (the next token's position), not the rows kept after eviction."""
        return self._cache.offset if self._cache is not None else 0

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        if isinstance(query_length, torch.Tensor):  # cache_position, before transformers 5.3
            query_length = query_length.shape[0]
        # The attention function computes the causal test from each row's own position; this is
        # the number of keys it attends over.
        stored = self._cache.stored_rows if self._cache is not None else 0
        return stored + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:  # the name of get_max_length before transformers 5.3
        return -1

    def reset(self) -> None:
        self._cache = None
        self._pending = False
        self.is_initialized = False

    def offload(self):
        raise RuntimeError("[veloxquant.Cache] offloading: expected offloading=False (not supported)")

    def prefetch(self):
        raise RuntimeError("[veloxquant.Cache] offloading: expected offloading=False (not supported)")

    def crop(self, tokens_to_remove: int) -> None:
        if self._cache is None or tokens_to_remove == 0:
            return
        if tokens_to_remove < 0:  # transformers' convention: crop to -n tokens
            tokens_to_remove = self._cache.offset + tokens_to_remove
        self._cache.trim(int(tokens_to_remove))  # refused (RuntimeError) by non-full methods

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise RuntimeError(
            f"[veloxquant.Cache] reorder_cache: method {self.config.method} cannot reorder the "
            "batch (beam search, contrastive search): use greedy or sampling with num_beams=1"
        )

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise RuntimeError(
            f"[veloxquant.Cache] batch_repeat_interleave: method {self.config.method} cannot "
            "repeat the batch: expected num_return_sequences=1 with num_beams=1"
        )

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise RuntimeError(
            f"[veloxquant.Cache] batch_select_indices: method {self.config.method} cannot "
            "select batch rows"
        )

    # -- veloxquant extras -------------------------------------------------------------------------
    def stats(self) -> dict:
        """The C++ cache's figures (bytes accounted/resident, fp16 bytes, method figures)."""
        if self._cache is None:
            return {"method": self.config.method, "tokens_seen": 0, "rows_stored": 0,
                    "bytes_accounted": 0, "bytes_resident": 0, "fp16_bytes": 0, "figures": {}}
        return self._cache.stats()

    def stored_positions(self, b: int = 0, h: int = 0) -> list:
        if self._cache is None:
            return []
        return list(self._cache.stored_positions(b, h))


class Cache(_HFCache):
    """A transformers Cache over veloxquant's compressed caches, one per layer.

    >>> import veloxquant
    >>> model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="veloxquant")
    >>> cache = veloxquant.Cache("snapkv+skvq:budget=256:bits_key=4:bits_value=4")
    >>> model.generate(ids, past_key_values=cache, max_new_tokens=32)

    `config` is a spec string, a dict of fields (with "method"), or a CacheConfig. With a model
    config (or num_layers) the layers are made up front, otherwise at their first update.
    kv_heads: (kv_head_first, kv_heads_total), the KV heads of each layer this cache holds under
    tensor parallelism; "auto" (the default) takes them from torch.distributed and the model
    config (tp_kv_heads: (0, 0) in a single process), so each rank's Hadamard signs and
    calibrated permutations are those of its global heads.
    Layer i takes entry i of the per-layer lists (skvq_layer_bits_key / skvq_layer_key_rows /
    skvq_layer_bits_value) and of skvq_perm_file, as the C++ builders do. With the number of
    layers known the lists must hold one entry per layer (ValueError now); layers made lazily
    refuse, at their first update, a list without their entry.
    """

    def __init__(self, config: "str | Mapping[str, Any] | CacheConfig" = "full",
                 model_config: Any = None, num_layers: int | None = None,
                 kv_heads: "tuple | str" = "auto"):
        self.cache_config = CacheConfig(config)
        if isinstance(kv_heads, str):
            if kv_heads != "auto":
                raise ValueError(f"[veloxquant.Cache] kv_heads: expected 'auto' or "
                                 f"(kv_head_first, kv_heads_total) but got {kv_heads!r}")
            kv_heads = tp_kv_heads(model_config) if model_config is not None else (0, 0)
        self.kv_heads = (int(kv_heads[0]), int(kv_heads[1]))
        if num_layers is None and model_config is not None:
            num_layers = int(model_config.num_hidden_layers)
        if num_layers is not None:
            _vq.check_layer_lists(self.cache_config.to_json(), int(num_layers))
            super().__init__(layers=[CacheLayer(self.cache_config, self.kv_heads, i)
                                     for i in range(num_layers)])
        else:
            super().__init__(layer_class_to_replicate=self._new_layer)

    def _new_layer(self) -> CacheLayer:
        # A lazily made layer's index: transformers' Cache.update(k, v, layer_idx) appends
        # layer_class_to_replicate() to self.layers until layer_idx exists, one call per new
        # layer, each appended right after it is made (transformers/cache_utils.py, Cache.update:
        # `while len(self.layers) <= layer_idx: self.layers.append(...)`), so the layer made now
        # lands at position len(self.layers). Tested in python/tests/test_layer_lists.py.
        return CacheLayer(self.cache_config, self.kv_heads, len(self.layers))

    @property
    def method(self) -> str:
        return self.cache_config.method

    def reorder_cache(self, beam_idx: torch.LongTensor):
        if not self.layers:
            return
        self.layers[0].reorder_cache(beam_idx)

    def crop(self, tokens_to_remove: int) -> None:
        if self.layers and self.layers[0]._cache is not None and not self.layers[0]._cache.is_trimmable():
            raise RuntimeError(
                f"[veloxquant.Cache] crop: expected a trimmable method (full) but got {self.method}"
            )
        super().crop(tokens_to_remove)

    @property
    def is_croppable(self) -> bool:
        return self.method == "full"

    @property
    def is_compileable(self) -> bool:
        # Every layer is (CacheLayer.is_compileable), including those the eager prefill makes
        # lazily: transformers asks before the prefill, when a lazily built cache has none yet.
        return True

    # -- figures ----------------------------------------------------------------------------------
    def stats(self) -> list:
        """Per layer, the C++ cache's figures (docs/design.md §C1 statistics)."""
        return [layer.stats() for layer in self.layers]

    def memory(self) -> dict:
        """Bytes of every layer: accounted (the method's formula), resident, and fp16 equivalent."""
        total = {"bytes_accounted": 0, "bytes_resident": 0, "fp16_bytes": 0}
        for st in self.stats():
            for key in total:
                total[key] += int(st[key])
        total["ratio_to_fp16"] = (total["bytes_accounted"] / total["fp16_bytes"]
                                  if total["fp16_bytes"] else 1.0)
        return total

    # -- state files ------------------------------------------------------------------------------
    def save(self, path_or_file) -> None:
        """Writes every layer's state (the C++ versioned, checksummed format) to one file."""
        layers = []
        for i, layer in enumerate(self.layers):
            if layer._cache is None:
                raise RuntimeError(f"[veloxquant.Cache] save: expected every layer to hold rows "
                                   f"but layer {i} has none yet")
            if layer._pending:
                raise RuntimeError("[veloxquant.Cache] save: expected no step in flight")
            layers.append((int(layer._cache.stats()["tokens_seen"]), layer._cache.save()))
        header = json.dumps({"config": self.cache_config.to_dict(),
                             "head_dim": [layer.head_dim for layer in self.layers],
                             "kv_heads": list(self.kv_heads)}).encode()
        buf = io.BytesIO()
        buf.write(_MAGIC + struct.pack("<II", _VERSION, len(header)) + header)
        buf.write(struct.pack("<I", len(layers)))
        for _, blob in layers:
            buf.write(struct.pack("<Q", len(blob)) + blob)
        data = buf.getvalue()
        if hasattr(path_or_file, "write"):
            path_or_file.write(data)
        else:
            with open(path_or_file, "wb") as f:
                f.write(data)

    def load(self, path_or_file, device: "str | torch.device | None" = None) -> None:
        """Reads a file written by save() (on either device). All or nothing: on any error
        (RuntimeError naming the problem) every layer is left as it was. `device`: where the
        layers' storage goes (default: this cache's device when its layers have one, else the
        CPU); a CUDA layer gets the batch and KV heads of the state, on torch's current stream."""
        if device is None:
            device = next((layer.device for layer in self.layers if layer.is_initialized),
                          torch.device("cpu"))
        device = torch.device(device)
        check_device(device)
        if device.type == "cuda" and device.index is None:  # compared with tensors' devices
            device = torch.device("cuda", torch.cuda.current_device())
        if hasattr(path_or_file, "read"):
            data = path_or_file.read()
        else:
            with open(path_or_file, "rb") as f:
                data = f.read()
        view = memoryview(data)

        def take(n: int, what: str) -> memoryview:
            nonlocal view
            if len(view) < n:
                raise RuntimeError(f"[veloxquant.Cache] load: expected {n} bytes of {what} but "
                                   f"got {len(view)} (truncated file)")
            out, view = view[:n], view[n:]
            return out

        if bytes(take(len(_MAGIC), "magic")) != _MAGIC:
            raise RuntimeError("[veloxquant.Cache] load: expected a veloxquant.Cache state file "
                               "(magic VQPYCACH) but got other bytes")
        version, header_len = struct.unpack("<II", take(8, "header"))
        if version != _VERSION:
            raise RuntimeError(f"[veloxquant.Cache] load: expected version {_VERSION} but got "
                               f"{version}")
        try:
            header = json.loads(bytes(take(header_len, "header")).decode())
            cfg = CacheConfig(header["config"])
            head_dims = [int(x) for x in header["head_dim"]]
            kv_heads = tuple(int(x) for x in header.get("kv_heads", (0, 0)))  # older files: (0, 0)
        except (ValueError, KeyError, TypeError) as e:
            raise RuntimeError(f"[veloxquant.Cache] load: expected a valid header but got {e}")
        if cfg != self.cache_config:
            raise RuntimeError("[veloxquant.Cache] load: expected a state of this cache's config "
                               f"{self.cache_config.to_dict()} but got {cfg.to_dict()}")
        if kv_heads != self.kv_heads:
            raise RuntimeError(f"[veloxquant.Cache] load: expected the state of KV heads (first, "
                               f"total) {self.kv_heads} but got {kv_heads}")
        (n_layers,) = struct.unpack("<I", take(4, "layer count"))
        if n_layers != len(head_dims) or (self.layers and n_layers != len(self.layers)):
            raise RuntimeError(f"[veloxquant.Cache] load: expected {len(self.layers)} layers "
                               f"but got {n_layers}")
        fresh = []
        for i in range(n_layers):
            (n,) = struct.unpack("<Q", take(8, f"layer {i} size"))
            blob = bytes(take(n, f"layer {i}"))
            layer = CacheLayer(self.cache_config, self.kv_heads, i)
            layer._cache = _vq.LayerCache(self.cache_config.to_json(), head_dims[i],
                                          *self.kv_heads, layer=i)
            layer._cache.load(blob)  # RuntimeError with the library's message on a bad state
            if device.type != "cpu":  # the checked state, now on the device (same format)
                cpu = layer._cache
                layer._cache = _new_storage(self.cache_config, head_dims[i], device, cpu.batch,
                                            cpu.n_kv_heads, self.kv_heads, i)
                layer._cache.load(blob)
            layer.is_initialized = True
            layer.head_dim = head_dims[i]
            layer.device = device
            fresh.append(layer)
        if len(view):
            raise RuntimeError(f"[veloxquant.Cache] load: expected the end of the file but got "
                               f"{len(view)} more bytes")
        self.layers[:] = fresh
