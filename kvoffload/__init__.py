"""kvoffload: KV-cache offloading to host memory, disk and a shared store.

Built first for hybrid models whose KV cache groups have different block
sizes. The public API is re-exported here; submodules are private to the
package unless documented.
"""

from typing import TYPE_CHECKING

from kvoffload.config import IgnoredKeysWarning, OffloadConfig, build_offloading_config
from kvoffload.errors import (
    ConfigError,
    CorruptChunkError,
    KVOffloadError,
    ProtocolError,
    TierError,
    TransferError,
)
from kvoffload.keys import namespace_of, prefix_keys, prefix_keys_for_layout
from kvoffload.layout import GROUP_KINDS, CacheGroup, KVLayout
from kvoffload.manager import (
    AdmissionFilter,
    ARCPolicy,
    EventKind,
    EvictionPolicy,
    IndexEvent,
    LoadResult,
    LRUPolicy,
    OffloadManager,
    S3FIFOPolicy,
    StoreResult,
)
from kvoffload.registry import POLICIES, TIERS

if TYPE_CHECKING:  # the lazy names below, for type checkers
    from kvoffload.cascade import TierCascade
    from kvoffload.engine import ChunkSpan, JobKind, JobResult, JobStatus, OffloadEngine
    from kvoffload.tiers.base import Tier
    from kvoffload.tiers.cpu import CPUTier
    from kvoffload.tiers.disk import DiskTier
    from kvoffload.transfer import BlockSpan, KVTransfer

# The data plane needs torch; it is imported on first use, so that the scheduler
# side and `kvoffload plan` start without paying for torch.
_LAZY = {
    "OffloadEngine": "kvoffload.engine",
    "JobKind": "kvoffload.engine",
    "JobResult": "kvoffload.engine",
    "JobStatus": "kvoffload.engine",
    "ChunkSpan": "kvoffload.engine",
    "KVTransfer": "kvoffload.transfer",
    "BlockSpan": "kvoffload.transfer",
    "Tier": "kvoffload.tiers.base",
    "CPUTier": "kvoffload.tiers.cpu",
    "DiskTier": "kvoffload.tiers.disk",
    "TierCascade": "kvoffload.cascade",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvoffload' has no attribute {name!r}")


__version__ = "0.1.0"

__all__ = [
    "GROUP_KINDS",
    "ARCPolicy",
    "AdmissionFilter",
    "BlockSpan",
    "CPUTier",
    "ChunkSpan",
    "DiskTier",
    "EventKind",
    "EvictionPolicy",
    "IndexEvent",
    "JobKind",
    "JobResult",
    "JobStatus",
    "KVTransfer",
    "LRUPolicy",
    "LoadResult",
    "OffloadEngine",
    "OffloadManager",
    "S3FIFOPolicy",
    "StoreResult",
    "Tier",
    "TierCascade",
    "namespace_of",
    "prefix_keys",
    "prefix_keys_for_layout",
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
