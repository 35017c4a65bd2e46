"""Configuration: the declarative key table, value coercion and ``OffloadConfig``."""

from kvoffload.config.build import IgnoredKeysWarning, build_offloading_config
from kvoffload.config.keys import KEYS, Key, KeyType, render_key_table
from kvoffload.config.offload_config import OffloadConfig

__all__ = [
    "KEYS",
    "IgnoredKeysWarning",
    "Key",
    "KeyType",
    "OffloadConfig",
    "build_offloading_config",
    "render_key_table",
]
