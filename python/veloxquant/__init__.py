"""veloxquant: compressed KV caches (SnapKV eviction, SKVQ group quantization, both composed)
for PyTorch and transformers, with the C++ library inside (the _veloxquant extension).

    import veloxquant
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="veloxquant")
    out = model.generate(ids, past_key_values=veloxquant.Cache("skvq:bits_key=4:bits_value=4"))

Importing the package registers the "veloxquant" attention function (attention.py).
"""

from . import _veloxquant
from .attention import register as _register
from .attention import veloxquant_attention
from .cache import Cache, CacheLayer, tp_kv_heads
from .config import CacheConfig, methods

__version__ = "0.1.0"
__all__ = ["Cache", "CacheLayer", "CacheConfig", "methods", "veloxquant_attention",
           "cuda_available", "tp_kv_heads"]


def cuda_available() -> bool:
    """True when the extension was built with CUDA and a device is present."""
    return bool(_veloxquant.cuda_available())


_register()
