"""kvoffload: KV-cache offloading to host memory, disk and a shared store.

Built first for hybrid models whose KV cache groups have different block
sizes. The public API is re-exported here; submodules are private to the
package unless documented.
"""

from typing import TYPE_CHECKING

from kvoffload.config import (
    GROUP_KINDS,
    CacheGroup,
    IgnoredKeysWarning,
    KVLayout,
    OffloadConfig,
    build_offloading_config,
    layout_from_hf_config,
)
from kvoffload.errors import (
    ConfigError,
    CorruptChunkError,
    IntegrityError,
    KVOffloadError,
    ProtocolError,
    TierError,
    TransferError,
)
from kvoffload.keys import namespace_of, prefix_keys, prefix_keys_for_layout
from kvoffload.manager import (
    AdaptivePolicy,
    AdmissionFilter,
    ARCPolicy,
    EventKind,
    EvictionPolicy,
    IndexEvent,
    LoadResult,
    LRUPolicy,
    OffloadIndex,
    S3FIFOPolicy,
    StoreResult,
)
from kvoffload.messages import (
    BlockSpan,
    ChunkSpan,
    JobKind,
    JobReport,
    JobResult,
    JobStatus,
    TransferOrder,
)
from kvoffload.registry import POLICIES, TIERS
from kvoffload.tiers.stats import TierStats

if TYPE_CHECKING:  # the lazy names below, for type checkers
    from kvoffload.engine import OffloadEngine
    from kvoffload.tiers.base import Tier
    from kvoffload.tiers.cascade import TierCascade
    from kvoffload.tiers.cpu import CPUSlab
    from kvoffload.tiers.disk import DiskTier
    from kvoffload.transfer import KVTransfer

# The data plane needs torch; it is imported on first use, so that the scheduler
# side and `kvoffload plan` start without paying for torch.
_LAZY = {
    "OffloadEngine": "kvoffload.engine",
    "KVTransfer": "kvoffload.transfer",
    "Tier": "kvoffload.tiers.base",
    "CPUSlab": "kvoffload.tiers.cpu",
    "DiskTier": "kvoffload.tiers.disk",
    "TierCascade": "kvoffload.tiers.cascade",
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
    "AdaptivePolicy",
    "AdmissionFilter",
    "BlockSpan",
    "CPUSlab",
    "ChunkSpan",
    "DiskTier",
    "EventKind",
    "EvictionPolicy",
    "IndexEvent",
    "JobKind",
    "JobReport",
    "JobResult",
    "JobStatus",
    "KVTransfer",
    "LRUPolicy",
    "LoadResult",
    "OffloadEngine",
    "OffloadIndex",
    "S3FIFOPolicy",
    "StoreResult",
    "Tier",
    "TransferOrder",
    "TierCascade",
    "TierStats",
    "namespace_of",
    "prefix_keys",
    "prefix_keys_for_layout",
    "POLICIES",
    "TIERS",
    "CacheGroup",
    "ConfigError",
    "CorruptChunkError",
    "IgnoredKeysWarning",
    "IntegrityError",
    "KVLayout",
    "KVOffloadError",
    "OffloadConfig",
    "ProtocolError",
    "TierError",
    "TransferError",
    "__version__",
    "build_offloading_config",
    "layout_from_hf_config",
]
