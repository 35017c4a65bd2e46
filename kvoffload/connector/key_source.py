"""Which hashes the connector's chunk keys are made from: the ``key_source`` key, resolved.

Token keys (:func:`~kvoffload.keys.extend_prefix_keys`) hash every prompt
token again after the engine hashed it for its prefix cache; engine keys
(:func:`~kvoffload.keys.extend_engine_keys`) chain the engine's own block hashes,
almost free, but are only as stable as those. ``auto`` takes engine keys
wherever that costs nothing: the engine's hashes are the same in every process,
or nothing outlives the process anyway (no disk or remote tier), every
group's chunk ends on a block hash, and no drafter's KV reads past a chunk
(the engine's hashes would not name those tokens).
"""

from __future__ import annotations

import logging

from kvoffload.config import OffloadConfig
from kvoffload.errors import ConfigError
from kvoffload.keys import EngineHashes

__all__ = ["choose_engine_hashes", "engine_keys_refusal"]

logger = logging.getLogger("kvoffload")


def engine_keys_refusal(lookahead: int) -> str:
    """Why engine keys cannot serve a layout whose KV reads ``lookahead`` tokens ahead."""
    return (
        f"key_source='engine' with a drafter whose KV reads {lookahead} token(s) past each "
        "chunk (EAGLE, EAGLE-3, MTP): the engine's block hashes do not name them; use "
        "key_source='auto' or 'tokens'"
    )


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
    if source == "tokens" or (source == "auto" and config.layout.lookahead):
        return None
    if source == "engine" and config.layout.lookahead:
        raise ConfigError(engine_keys_refusal(config.layout.lookahead))
    lasting = config.disk_path is not None or config.remote_url is not None
    if source == "engine":
        for span in config.tokens_per_chunk:
            engine.check_span(span)
        if lasting and not reproducible:
            logger.warning(
                "kvoffload: key_source='engine' with the engine's %s hashes, which differ per "
                "process (PYTHONHASHSEED is unset): the disk and remote tiers serve only this "
                "process; "
                "set PYTHONHASHSEED, or key_source='auto'",
                engine.algorithm,
            )
        return engine
    if source != "auto":
        raise ConfigError(f"key_source={source!r}: expected 'auto', 'tokens' or 'engine'")
    if any(span % engine.block_size for span in config.tokens_per_chunk):
        return None
    return engine if reproducible or not lasting else None
