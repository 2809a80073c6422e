"""Cache configurations: the CLI's compact specs, JSON objects and keyword fields, one parser.

Every source goes through the C++ parser (src/core/cache_config.cpp, docs/design.md §C6), so a
spec means in Python exactly what it means on the command line, and a refusal carries the
library's message ("[cache_config] snap_budget: expected >= 1 but got 0") as a ValueError.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from . import _veloxquant as _vq


class CacheConfig:
    """A checked cache configuration (method + its fields), built from a spec, JSON or fields.

    >>> CacheConfig("snapkv+skvq:budget=256:bits_key=4:bits_value=4")
    >>> CacheConfig(method="skvq", bits_key=4, bits_value=4)   # short names, as in a spec
    >>> CacheConfig({"method": "snapkv", "snap_budget": 128})    # a JSON object / dict
    """

    def __init__(self, spec: "str | Mapping[str, Any] | CacheConfig | None" = None, **fields: Any):
        if isinstance(spec, CacheConfig):
            text = _vq.normalize_config(json.dumps({**spec.to_dict(), **fields}))
        elif isinstance(spec, Mapping):
            text = _vq.normalize_config(json.dumps({**dict(spec), **fields}))
        elif isinstance(spec, str) or spec is None:
            # Keyword fields are spec assignments after the spec's own (one key rule: short or
            # full names of the method's fields).
            method = str(fields.pop("method", "full")) if spec is None else spec
            extra = [f"{key}={_spec_value(value)}" for key, value in fields.items()]
            text = _vq.parse_spec(":".join([method] + extra))
        else:
            raise ValueError(
                "[veloxquant.CacheConfig] expected a spec string, a mapping or a CacheConfig "
                f"but got {type(spec).__name__}"
            )
        self._fields: dict = json.loads(text)
        self._fields.pop("head_dim", None)  # set per layer from the model's tensors

    @property
    def method(self) -> str:
        return self._fields["method"]

    def to_dict(self) -> dict:
        return dict(self._fields)

    def to_json(self) -> str:
        return json.dumps(self._fields)

    def __getitem__(self, key: str) -> Any:
        return self._fields[key]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CacheConfig) and self._fields == other._fields

    def __repr__(self) -> str:
        return f"CacheConfig({self._fields!r})"


def _spec_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    text = str(value)
    if ":" in text:
        raise ValueError(f"[veloxquant.CacheConfig] expected a value without ':' but got {text!r}")
    return text


def methods() -> list:
    """The cache methods the library knows."""
    return list(_vq.cache_methods())
