"""The namespace: a fingerprint of everything that makes stored KV bytes reusable."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Protocol

from kvoffload.errors import ConfigError
from kvoffload.keys._extras import KEY_BYTES, canonical

__all__ = ["namespace_of"]

_NAMESPACE_TAG = b"kvoffload/namespace/v1\x00"


class _Group(Protocol):
    """What :func:`namespace_of` reads of a ``kvoffload.config.layout.CacheGroup``."""

    @property
    def kind(self) -> str: ...
    @property
    def tokens_per_block(self) -> int: ...
    @property
    def layer_names(self) -> Sequence[str]: ...
    @property
    def page_bytes(self) -> int: ...
    @property
    def sliding_window(self) -> int | None: ...
    @property
    def attention_chunk_size(self) -> int | None: ...
    @property
    def layer_page_bytes(self) -> Sequence[int] | None: ...


class _Layout(Protocol):
    """What :func:`namespace_of` reads of a ``kvoffload.config.layout.KVLayout``."""

    @property
    def groups(self) -> Sequence[_Group]: ...
    @property
    def lookahead(self) -> int: ...


def namespace_of(model_id: str, dtype: object, layout: _Layout) -> bytes:
    """A 16-byte fingerprint of everything that makes stored KV bytes reusable.

    Model id, dtype and, per group in order: kind, tokens per block, layer
    names, page bytes, sliding window and, where set, attention chunk and
    per-layer page bytes, and the layout's lookahead where set (absent ones
    leave older namespaces unchanged).
    ``dtype`` may be a string or a ``torch.dtype``; ``"torch.bfloat16"`` and
    ``"bfloat16"`` agree.
    """
    if not isinstance(model_id, str) or not model_id:
        raise ConfigError(f"model_id must be a non-empty str, got {model_id!r}")
    dtype_name = str(dtype).removeprefix("torch.")
    if not dtype_name:
        raise ConfigError("dtype must name a dtype, got an empty string")
    groups: list[dict[str, object]] = []
    for g in layout.groups:
        fields: dict[str, object] = {
            "kind": str(g.kind),
            "tokens_per_block": int(g.tokens_per_block),
            "layer_names": [str(n) for n in g.layer_names],
            "page_bytes": int(g.page_bytes),
            "sliding_window": None if g.sliding_window is None else int(g.sliding_window),
        }
        if g.attention_chunk_size is not None:
            fields["attention_chunk_size"] = int(g.attention_chunk_size)
        if g.layer_page_bytes is not None:
            fields["layer_page_bytes"] = [int(p) for p in g.layer_page_bytes]
        groups.append(fields)
    document: dict[str, object] = {"model": model_id, "dtype": dtype_name, "groups": groups}
    if layout.lookahead:
        document["lookahead"] = int(layout.lookahead)
    return hashlib.blake2b(_NAMESPACE_TAG + canonical(document), digest_size=KEY_BYTES).digest()
