"""kvoffload: KV-cache offloading to host memory, disk and a shared store.

Built first for hybrid models whose KV cache groups have different block
sizes. The public API is re-exported here; submodules are private to the
package unless documented.
"""

from kvoffload.config import IgnoredKeysWarning, OffloadConfig, build_offloading_config
from kvoffload.errors import (
    ConfigError,
    CorruptChunkError,
    KVOffloadError,
    ProtocolError,
    TierError,
    TransferError,
)
from kvoffload.layout import GROUP_KINDS, CacheGroup, KVLayout
from kvoffload.registry import POLICIES, TIERS

__version__ = "0.1.0"

__all__ = [
    "GROUP_KINDS",
    "POLICIES",
    "TIERS",
    "CacheGroup",
    "ConfigError",
    "CorruptChunkError",
    "IgnoredKeysWarning",
    "KVLayout",
    "KVOffloadError",
    "OffloadConfig",
    "ProtocolError",
    "TierError",
    "TransferError",
    "__version__",
    "build_offloading_config",
]
