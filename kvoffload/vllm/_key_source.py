"""Whether vLLM's block hashes are the same in every process (for ``key_source: auto``).

The choice itself is engine-neutral (:mod:`kvoffload.connector.key_source`); what vLLM adds
is which of its hash algorithms are seeded per process.
"""

from __future__ import annotations

import os

__all__ = ["vllm_hashes_reproducible"]

#: vLLM's hash algorithms whose seed is random per process unless PYTHONHASHSEED is set
#: (vllm/v1/core/kv_cache_utils.py, ``resolve_none_hash_seed``, 0.32 and 0.33).
_PER_PROCESS_ALGORITHMS = frozenset({"xxhash", "xxhash_cbor"})


def vllm_hashes_reproducible(algorithm: str) -> bool:
    """Whether vLLM's block hashes under ``algorithm`` are equal in every process."""
    return algorithm not in _PER_PROCESS_ALGORITHMS or os.environ.get("PYTHONHASHSEED") is not None
