"""kvpress integration: its question-answering pipeline over a veloxquant.Cache.

kvpress's "kv-press-text-generation" pipeline prefills the context into the `cache=` it is given,
answers each question greedily, and after each answer drops the answer's rows by slicing the
layers' dense `keys`/`values` tensors. A veloxquant layer holds packed rows, not tensors, and only
the full method can trim, so `pipeline()` returns kvpress's pipeline with that one step replaced:
the cache's state (the C++ state bytes) is kept before each answer and restored after it, for
every method. kvpress's presses themselves rewrite dense keys/values in forward hooks and do not
apply to packed storage; the veloxquant method (SnapKV, SKVQ, both) is the compression.
Needs `pip install kvpress` (imported on first use only).
"""

from __future__ import annotations

import io

from .cache import Cache


def pipeline(model, tokenizer, **kwargs):
    """kvpress's text-generation pipeline whose `cache=` may be a veloxquant.Cache."""
    from kvpress.pipeline import KVPressTextGenerationPipeline

    class VeloxquantPressPipeline(KVPressTextGenerationPipeline):
        def generate_answer(self, question_ids, cache, context_length, max_new_tokens):
            if isinstance(cache, Cache):
                buf = io.BytesIO()
                cache.save(buf)
                cache._kvpress_state = buf.getvalue()
            return super().generate_answer(question_ids, cache, context_length, max_new_tokens)

        def _remove_answer_from_cache(self, cache, cache_seq_lengths):
            if isinstance(cache, Cache):
                cache.load(io.BytesIO(cache.__dict__.pop("_kvpress_state")))
                return
            super()._remove_answer_from_cache(cache, cache_seq_lengths)

    return VeloxquantPressPipeline(model=model, tokenizer=tokenizer, **kwargs)
