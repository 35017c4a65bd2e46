"""kvoffload's :class:`KVLayout` from vLLM's ``KVCacheConfig``, refusing what it cannot serve.

Each vLLM KV cache group becomes one :class:`CacheGroup` in the same order,
so group indices and block id lists line up with vLLM's. A group kind
kvoffload cannot offload correctly yet is refused at engine start, naming the
group and its spec, never served wrongly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from kvoffload.config.layout import CacheGroup, KVLayout
from kvoffload.errors import ConfigError

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec

__all__ = ["layout_from_kv_cache_config"]


def _kind(spec: KVCacheSpec) -> tuple[str, int | None]:
    """(kind, sliding window) of a spec kvoffload serves; ``ConfigError`` otherwise."""
    name = type(spec).__name__
    if isinstance(spec, SlidingWindowSpec) and type(spec) is SlidingWindowSpec:
        return "sliding", spec.sliding_window + getattr(spec, "extra_retained_tokens", 0)
    if isinstance(spec, MLAAttentionSpec) and type(spec) is MLAAttentionSpec:
        return "mla", None
    if type(spec) is FullAttentionSpec and spec.attention_chunk_size is None:
        # A sliding window kept as full attention (hybrid allocator off) keeps every
        # block, so serving it like full attention is exact.
        return "full", None
    raise ConfigError(
        f"KVOffloadConnector cannot offload KV cache groups of kind {name} yet "
        "(supported: full attention, sliding window, MLA); run this model without "
        "the connector"
    )


def layout_from_kv_cache_config(kv_cache_config: KVCacheConfig) -> KVLayout:
    """The layout of every group of ``kv_cache_config``, in vLLM's group order."""
    groups = []
    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        try:
            kind, window = _kind(spec)
        except ConfigError as exc:
            raise ConfigError(
                f"KV cache group {g} ({len(group.layer_names)} layers): {exc}"
            ) from None
        groups.append(
            CacheGroup(
                kind=kind,
                tokens_per_block=int(spec.block_size),
                layer_names=tuple(group.layer_names),
                page_bytes=int(spec.page_size_bytes),
                sliding_window=window,
            )
        )
    if not groups:
        raise ConfigError("KVOffloadConnector: the model has no KV cache groups to offload")
    return KVLayout(groups=tuple(groups))
