"""What the connector reads from vLLM's configuration at engine start, and what it refuses there.

Both sides run this in their constructor, before any request: a setting the
connector cannot serve fails engine start with one ``ConfigError`` naming it
(DESIGN.md, invariant 4), and both sides derive the same key namespace.
"""

from __future__ import annotations

from typing import Any

from kvoffload.config import OffloadConfig
from kvoffload.connector.key_source import choose_engine_hashes
from kvoffload.connector.loads import loads_in_step
from kvoffload.connector.scheduler import OffloadScheduler
from kvoffload.errors import ConfigError
from kvoffload.keys import EngineHashes
from kvoffload.tiers.from_config import rank_probes
from kvoffload.vllm._key_source import vllm_hashes_reproducible
from kvoffload.vllm._layout import GroupMap

__all__ = ["SERVED_DRAFTERS", "build_scheduler", "check_engine", "kv_identity", "refuse_draft_kv"]


def check_engine(vllm_config: Any) -> None:
    """Refuse, naming the setting, what the connector cannot serve in any layout."""
    refuse_draft_kv(vllm_config)
    pipeline = vllm_config.parallel_config.pipeline_parallel_size
    if pipeline != 1:
        raise ConfigError(
            f"KVOffloadConnector: pipeline_parallel_size={pipeline} is not supported yet; "
            "run with pipeline_parallel_size=1"
        )


def kv_identity(vllm_config: Any, groups: GroupMap) -> str:
    """What besides dtype and layout the KV bytes depend on, for the key namespace.

    The model, the draft model whose layers share the chunks (two drafters of
    one shape write different KV), and the spec fields that order a page's
    bytes otherwise (:data:`~kvoffload.vllm._layout.SPEC_FIELDS`). A field
    at its default adds nothing, so vLLM versions without it share chunks.
    """
    parts = [str(vllm_config.model_config.model)]
    spec = vllm_config.speculative_config
    if spec is not None and spec.method in SERVED_DRAFTERS:
        parts.append(f"draft={spec.draft_model_config.model}")
    parts += [f"{name}={value}" for name, value in groups.page_format]
    return "|".join(parts)


def build_scheduler(
    vllm_config: Any, kv_cache_config: Any, config: OffloadConfig, namespaces: list[bytes]
) -> OffloadScheduler:
    """The scheduler side's core, keyed from vLLM's block hashes where ``key_source`` allows."""
    algorithm = str(vllm_config.cache_config.prefix_caching_hash_algo)
    hashed_every = int(kv_cache_config.hash_block_size or config.layout.tokens_per_block[0])
    return OffloadScheduler(
        config,
        namespaces[0],
        rank_probes(config, namespaces),
        world_size=len(namespaces),
        engine_hashes=choose_engine_hashes(
            config,
            EngineHashes(hashed_every, algorithm),
            reproducible=vllm_hashes_reproducible(algorithm),
        ),
        load_in_step=loads_in_step(config, len(kv_cache_config.kv_cache_groups)),
    )


#: Drafters whose KV kvoffload offloads with the target's: a separate draft model reads the
#: target's tokens unshifted, so its KV at a position depends on the tokens up to it alone.
SERVED_DRAFTERS = ("draft_model",)


def refuse_draft_kv(vllm_config: Any) -> None:
    """Speculative methods whose drafter's KV kvoffload cannot offload exactly are refused, by name.

    A separate draft model (``draft_model``) writes KV from the target's own
    tokens, so its KV up to a position depends on the tokens up to it, as the
    target's does: its layers are served in the groups vLLM puts them in. vLLM
    runs the drafter before the connector's ``wait_for_save`` (0.32 defers it
    when a drafter runs), and a store covers only tokens the target computed,
    whose drafter KV that step has written for good; the positions a rejected
    draft can still rewrite lie past them.

    EAGLE-like drafters (``eagle``, ``eagle3``, ``mtp``, ``dflash``, ``dspark``)
    read the target's hidden states shifted by one token: their KV at a
    block's last position depends on the token after the block, which a
    chunk's key does not name (vLLM drops that block from every prefix-cache
    hit for them, or from 0.34 hashes the tokens after it). ``extract_hidden_states``
    keeps hidden states, not KV a later request's prefill recomputes. Both are
    refused; methods without drafter KV (ngram, suffix; medusa and
    mlp_speculator before 0.34) are served.
    """
    spec = vllm_config.speculative_config
    if spec is None or not spec.uses_draft_kv_cache() or spec.method in SERVED_DRAFTERS:
        return
    why = (
        "its drafter's KV at a chunk's last token depends on the token after the chunk, which "
        "the chunk's key does not name"
        if spec.use_eagle()
        else "its drafter keeps hidden states that no prefix hit restores"
    )
    raise ConfigError(
        f"KVOffloadConnector: speculative decoding with method {spec.method!r} is not offloaded "
        f"yet: {why}; use a separate draft model (method 'draft_model') or a method without "
        "drafter KV (ngram, suffix), or run without the connector"
    )
