"""Which hashes the connector's chunk keys are made from: the ``key_source`` key, resolved.

Token keys (:func:`~kvoffload.keys.extend_prefix_keys`) hash every prompt
token again after vLLM hashed it for its prefix cache; engine keys
(:func:`~kvoffload.keys.extend_engine_keys`) chain vLLM's own block hashes,
almost free, but are only as stable as those. ``auto`` takes engine keys
wherever that costs nothing: vLLM's hashes are the same in every process,
or nothing outlives the process anyway (no disk or remote tier), and every
group's chunk ends on a block hash.
"""

from __future__ import annotations

import logging
import os

from kvoffload.config import OffloadConfig
from kvoffload.errors import ConfigError
from kvoffload.keys import EngineHashes

__all__ = ["choose_engine_hashes", "vllm_hashes_reproducible"]

logger = logging.getLogger("kvoffload")

#: vLLM's hash algorithms whose seed is random per process unless PYTHONHASHSEED is set
#: (vllm/v1/core/kv_cache_utils.py, ``resolve_none_hash_seed``, 0.32 and 0.33).
_PER_PROCESS_ALGORITHMS = frozenset({"xxhash", "xxhash_cbor"})


def vllm_hashes_reproducible(algorithm: str) -> bool:
    """Whether vLLM's block hashes under ``algorithm`` are equal in every process."""
    return algorithm not in _PER_PROCESS_ALGORITHMS or os.environ.get("PYTHONHASHSEED") is not None


def choose_engine_hashes(
    config: OffloadConfig, engine: EngineHashes, *, reproducible: bool
) -> EngineHashes | None:
    """``engine`` if ``config.key_source`` makes keys from the engine's hashes, else ``None``.

    ``reproducible``: whether the engine's hashes are equal in every process.
    ``engine`` refuses chunks that do not end on a block hash (``ConfigError``)
    and warns where the disk or remote tier would gain nothing across
    processes; ``auto`` falls back to token keys there instead.
    """
    source = config.key_source
    if source == "tokens":
        return None
    lasting = config.disk_path is not None or config.remote_url is not None
    if source == "engine":
        for span in config.tokens_per_chunk:
            engine.check_span(span)
        if lasting and not reproducible:
            logger.warning(
                "kvoffload: key_source='engine' with vLLM's %s hashes, which differ per process "
                "(PYTHONHASHSEED is unset): the disk and remote tiers serve only this process; "
                "set PYTHONHASHSEED, or key_source='auto'",
                engine.algorithm,
            )
        return engine
    if source != "auto":
        raise ConfigError(f"key_source={source!r}: expected 'auto', 'tokens' or 'engine'")
    if any(span % engine.block_size for span in config.tokens_per_chunk):
        return None
    return engine if reproducible or not lasting else None
