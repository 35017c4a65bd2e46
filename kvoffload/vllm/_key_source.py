"""Whether vLLM's block hashes are the same in every process (for ``key_source: auto``).

The choice itself is engine-neutral (:mod:`kvoffload.connector.key_source`); what vLLM adds
is which of its hash algorithms are seeded per process.
"""

from __future__ import annotations

import hashlib
import os

__all__ = ["hash_seed_fingerprint", "vllm_hashes_reproducible"]

#: vLLM's hash algorithms whose seed is random per process unless PYTHONHASHSEED is set
#: (vllm/v1/core/kv_cache_utils.py, ``resolve_none_hash_seed``, 0.32 and 0.33).
_PER_PROCESS_ALGORITHMS = frozenset({"xxhash", "xxhash_cbor"})


def vllm_hashes_reproducible(algorithm: str) -> bool:
    """Whether vLLM's block hashes under ``algorithm`` are equal in every process."""
    return algorithm not in _PER_PROCESS_ALGORITHMS or os.environ.get("PYTHONHASHSEED") is not None


def hash_seed_fingerprint(algorithm: str) -> str:
    """What seeds vLLM's hashes under ``algorithm``, as engines can compare it in public.

    A cryptographic algorithm's seed (``PYTHONHASHSEED``, or vLLM's fixed default) needs
    no secrecy: a short digest of it. A per-process algorithm's seed must stay secret
    (its collision resistance rests on it), so it is only said whether one is shared.
    """
    seed = os.environ.get("PYTHONHASHSEED")
    if algorithm in _PER_PROCESS_ALGORITHMS:
        return "shared (PYTHONHASHSEED)" if seed is not None else "random per process"
    if seed is None:
        return "vLLM's default"
    return "PYTHONHASHSEED " + hashlib.blake2b(seed.encode(), digest_size=4).hexdigest()
