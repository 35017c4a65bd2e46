"""Configuration: the model's KV cache layout, the declarative key table, ``OffloadConfig``.

Everything a user or an engine hands kvoffload is checked here, once: the
layout (:mod:`.layout`, from vLLM's groups or a Hugging Face ``config.json``
via :mod:`.hf_layout`) and the connector's settings
(:func:`build_offloading_config`). Code further down trusts the results.
"""

from kvoffload.config.build import IgnoredKeysWarning, build_offloading_config
from kvoffload.config.hf_layout import layout_from_hf_config
from kvoffload.config.keys import KEYS, Key, KeyType, render_key_table
from kvoffload.config.layout import GROUP_KINDS, CacheGroup, KVLayout, Reuse
from kvoffload.config.offload_config import OffloadConfig

__all__ = [
    "GROUP_KINDS",
    "KEYS",
    "CacheGroup",
    "IgnoredKeysWarning",
    "KVLayout",
    "Key",
    "KeyType",
    "OffloadConfig",
    "Reuse",
    "build_offloading_config",
    "layout_from_hf_config",
    "render_key_table",
]
