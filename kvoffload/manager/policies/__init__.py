"""Eviction policies of the offload index and the admission filter that wraps them.

Build one by name through ``kvoffload.registry.POLICIES``; the classes are
re-exported here for callers that compose them (``AdmissionFilter(LRUPolicy(n))``).
"""

from __future__ import annotations

from kvoffload.manager.policies.adaptive import AdaptivePolicy
from kvoffload.manager.policies.admission import AdmissionFilter
from kvoffload.manager.policies.arc import ARCPolicy
from kvoffload.manager.policies.lru import LRUPolicy
from kvoffload.manager.policies.s3fifo import S3FIFOPolicy

__all__ = ["ARCPolicy", "AdaptivePolicy", "AdmissionFilter", "LRUPolicy", "S3FIFOPolicy"]
