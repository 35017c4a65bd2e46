"""What the connector reads from vLLM's configuration at engine start, and what it refuses there.

Both sides run this in their constructor, before any request: a setting the
connector cannot serve fails engine start with one ``ConfigError`` naming it
(DESIGN.md, invariant 4), and both sides derive the same key namespace.
:class:`EngineSetup` is what the two sides build alike.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

import vllm

from kvoffload.config import OffloadConfig, build_offloading_config
from kvoffload.config.layout import KVLayout
from kvoffload.connector.key_source import choose_engine_hashes
from kvoffload.connector.loads import hit_loading
from kvoffload.connector.scheduler import OffloadScheduler
from kvoffload.errors import ConfigError
from kvoffload.keys import EngineHashes, namespace_of
from kvoffload.keys.identity import KeyIdentity
from kvoffload.tiers.cards import exchange_cards
from kvoffload.tiers.from_config import rank_probes
from kvoffload.tiers.handoff import handoff_board
from kvoffload.vllm._key_source import hash_seed_fingerprint, vllm_hashes_reproducible
from kvoffload.vllm._layout import GroupMap, group_map
from kvoffload.vllm._versions import announce

logger = logging.getLogger("kvoffload")
#: Under vLLM's own logger, so that the release line shows beside vLLM's at INFO.
engine_log = logging.getLogger("vllm.kvoffload")

__all__ = [
    "SERVED_DRAFTERS",
    "EngineSetup",
    "build_scheduler",
    "check_engine",
    "drafter_lookahead",
    "kv_identity",
    "refuse_draft_kv",
    "warn_draft_group",
]


@dataclass(frozen=True, slots=True)
class EngineSetup:
    """What the scheduler side and every worker build alike from vLLM's configuration.

    Built in one place because the sides must agree: a worker stores chunks of
    the layout's sizes under its rank's namespace, and the scheduler side
    finds them only if it computed the same layout, configuration and
    namespaces from the same engine settings.
    """

    #: vLLM's groups as served (the layout) or skipped; see ``kvoffload.vllm._layout``.
    groups: GroupMap
    #: ``kv_connector_extra_config``, validated against the layout (one message if bad).
    config: OffloadConfig
    #: vLLM's ``tensor_parallel_size``: how many worker ranks the engine runs.
    world_size: int
    #: What besides dtype and layout the KV bytes depend on (:func:`kv_identity`).
    model_id: str
    #: The model's dtype, in the namespace: the same model in another dtype is other bytes.
    dtype: str

    @classmethod
    def read(cls, vllm_config: Any, kv_cache_config: Any) -> EngineSetup:
        """Check the engine, read its layout and validate ``kv_connector_extra_config``."""
        check_engine(vllm_config, kv_cache_config)
        groups = group_map(kv_cache_config, drafter_lookahead(vllm_config))
        transfer = vllm_config.kv_transfer_config
        extra = dict(transfer.kv_connector_extra_config or {})
        world_size = vllm_config.parallel_config.tensor_parallel_size
        config = build_offloading_config(
            extra, groups.layout, world_size, kv_role=transfer.kv_role, warn=logger.warning
        )
        model_id = kv_identity(vllm_config, groups)
        return cls(groups, config, world_size, model_id, str(vllm_config.model_config.dtype))

    @property
    def layout(self) -> KVLayout:
        """The served groups' layout, which sizes the chunks and CPU slots on both sides."""
        return self.groups.layout

    def namespace(self, rank: int) -> bytes:
        """Rank ``rank``'s namespace: its own if ranks hold shards, one if all is replicated."""
        shards = self.world_size > 1 and not self.layout.replicated
        model = f"{self.model_id}#tp{rank}" if shards else self.model_id
        return namespace_of(model, self.dtype, self.layout)


def check_engine(vllm_config: Any, kv_cache_config: Any) -> None:
    """Refuse, naming the setting, what the connector cannot serve in any layout."""
    refuse_draft_kv(vllm_config)
    warn_draft_group(vllm_config, kv_cache_config)
    pipeline = vllm_config.parallel_config.pipeline_parallel_size
    if pipeline != 1:
        raise ConfigError(
            f"KVOffloadConnector: pipeline_parallel_size={pipeline} is not supported yet; "
            "run with pipeline_parallel_size=1"
        )


def kv_identity(vllm_config: Any, groups: GroupMap) -> str:
    """What besides dtype and layout the KV bytes depend on, for the key namespace.

    The model, the drafter whose layers share the chunks (two drafters of one
    shape write different KV; an EAGLE-like one with its method), and the
    spec fields that order a page's bytes otherwise
    (:data:`~kvoffload.vllm._layout.SPEC_FIELDS`). A field at its default
    adds nothing, so vLLM versions without it share chunks.
    """
    parts = [str(vllm_config.model_config.model)]
    spec = vllm_config.speculative_config
    if spec is not None and spec.method in SERVED_DRAFTERS:
        parts.append(f"draft={spec.draft_model_config.model}")
    elif spec is not None and spec.use_eagle():  # its layers may share the target's names
        draft = getattr(spec.draft_model_config, "model", None)
        parts.append(f"{spec.method}={draft}")
    parts += [f"{name}={value}" for name, value in groups.page_format]
    return "|".join(parts)


def build_scheduler(
    vllm_config: Any, kv_cache_config: Any, setup: EngineSetup, namespaces: list[bytes]
) -> OffloadScheduler:
    """The scheduler side's core, keyed from vLLM's block hashes where ``key_source`` allows.

    One per engine: where the vLLM release it runs on is logged (and warned of, if newer
    than the releases checked). A split role's engine logs what it does, and warns if
    the engines of the other role on its shared tier name chunks otherwise
    (:mod:`kvoffload.tiers.cards`).
    """
    announce(vllm.__version__, engine_log)
    config = setup.config
    algorithm = str(vllm_config.cache_config.prefix_caching_hash_algo)
    hashed_every = int(kv_cache_config.hash_block_size or config.layout.tokens_per_block[0])
    engine_hashes = choose_engine_hashes(
        config,
        EngineHashes(hashed_every, algorithm),
        reproducible=vllm_hashes_reproducible(algorithm),
    )
    if config.kv_role.disaggregated:
        log_role(config)
        mismatch = exchange_cards(config, key_identity(setup, namespaces, engine_hashes))
        if mismatch is not None:
            logger.warning(mismatch)
    return OffloadScheduler(
        config,
        namespaces[0],
        rank_probes(config, namespaces),
        world_size=len(namespaces),
        engine_hashes=engine_hashes,
        hit_loading=hit_loading(config, len(kv_cache_config.kv_cache_groups)),
        handoff=handoff_board(config, namespaces),
    )


def log_role(config: OffloadConfig) -> None:
    does = "loads" if config.loads else "never loads"
    does += ", stores" if config.stores else ", never stores"
    if config.announces_stores:
        does += f", marks its stores for consumers ({config.handoff_wait_ms} ms)"
    elif config.awaits_handoffs:
        does += f", waits up to {config.handoff_wait_ms} ms for marked stores"
    engine_log.info("kvoffload: kv_role %s: %s", config.kv_role, does)


def key_identity(
    setup: EngineSetup, namespaces: list[bytes], engine_hashes: EngineHashes | None
) -> KeyIdentity:
    """How this engine names its chunks, for the engines of the other role to compare."""
    config = setup.config
    if engine_hashes is None:
        source = "token ids"
    else:
        source = (
            f"vLLM's {engine_hashes.algorithm} block hashes per {engine_hashes.block_size} "
            f"tokens, seed {hash_seed_fingerprint(engine_hashes.algorithm)}"
        )
    groups = tuple(
        f"{g.kind} {g.tokens_per_block} tokens/block {g.page_bytes} B/page"
        for g in setup.layout.groups
    )
    return KeyIdentity(
        role=str(config.kv_role),
        model=setup.model_id,
        dtype=setup.dtype.removeprefix("torch."),
        world_size=setup.world_size,
        sharded=setup.world_size > 1 and not setup.layout.replicated,
        groups=groups,
        tokens_per_chunk=tuple(config.tokens_per_chunk),
        key_source=source,
        namespaces=tuple(dict.fromkeys(ns.hex() for ns in namespaces)),
    )


#: Drafters whose KV kvoffload offloads with the target's, besides the EAGLE-like ones
#: (``SpeculativeConfig.use_eagle()``): a separate draft model reads the target's tokens
#: unshifted, so its KV at a position depends on the tokens up to it alone.
SERVED_DRAFTERS = ("draft_model",)


def refuse_draft_kv(vllm_config: Any) -> None:
    """Speculative methods whose drafter's KV kvoffload cannot offload exactly are refused, by name.

    Every drafter whose KV a later request's prefill would compute again is
    served: a separate draft model (``draft_model``), and the EAGLE-like ones
    (``eagle``, ``eagle3``, ``mtp`` and the ``*_mtp`` methods, ``dflash``,
    ``dspark``), whose KV reads past a chunk (:func:`drafter_lookahead`).
    vLLM runs the drafter before the connector's ``wait_for_save`` (0.32
    defers it when a drafter runs), and a store covers only tokens whose
    drafter KV that step has written for good; the positions a rejected draft
    can still rewrite lie past them. ``extract_hidden_states`` keeps hidden
    states for another consumer, not KV a prefix hit could restore: refused.
    Methods without drafter KV (ngram, suffix, medusa) need nothing.
    """
    spec = vllm_config.speculative_config
    if spec is None or not spec.uses_draft_kv_cache() or spec.method in SERVED_DRAFTERS:
        return
    if spec.use_eagle():
        return
    raise ConfigError(
        f"KVOffloadConnector: speculative decoding with method {spec.method!r} is not offloaded: "
        "it does not speculate, and keeps the target's hidden states for a hidden-state export "
        "connector (ExampleHiddenStatesConnector), not KV a prefix hit restores; use a drafter "
        "(draft_model, eagle, eagle3, mtp) or a method without drafter KV (ngram, suffix), or "
        "run without the connector"
    )


def warn_draft_group(vllm_config: Any, kv_cache_config: Any) -> None:
    """Warn of vLLM 0.32/0.33 misrouting a draft model's KV beside a hybrid target.

    Their GPU model runner gives the drafter its own group's block table only
    for EAGLE-like drafters; a ``draft_model`` whose layers sit in a group of
    their own (beside Gemma-4's sliding and full groups, say) reads and writes
    its KV through the first group's, so a request served from any cache
    (vLLM's own or the connector's) may generate other tokens than cold
    (``tests_e2e/test_speculative_hybrid.py`` shows it, and that with vLLM
    patched the connector is exact). vLLM's bug, so a warning, not a refusal.
    """
    spec = vllm_config.speculative_config
    version = tuple(int(p) for p in re.findall(r"\d+", vllm.__version__)[:2])
    if spec is None or spec.method != "draft_model" or version >= (0, 34):
        return
    if len(kv_cache_config.kv_cache_groups) > 1:
        logger.warning(
            "kvoffload: vLLM %s runs a draft model beside a target of several KV cache groups "
            "through the first group's block table (vLLM's bug): answers served from any cache, "
            "vLLM's own or kvoffload's, may differ from a cold run; upgrade vLLM, or use an "
            "EAGLE-like drafter or ngram",
            vllm.__version__,
        )


def drafter_lookahead(vllm_config: Any) -> int:
    """Tokens after a position that the drafter's KV there depends on (0 without such a drafter).

    An EAGLE-like drafter computes its KV at position ``p`` from the target's
    hidden state at ``p`` and the token at ``p + 1`` (a multi-module MTP: up
    to ``p + k``), so the KV of a chunk's last positions depends on tokens
    after the chunk. vLLM's own prefix cache drops the last block of every hit
    for them (0.34: or hashes the tokens after each block). kvoffload's keys
    name those tokens instead (:attr:`KVLayout.lookahead`), so a hit loses
    nothing when the request goes on as the stored one did. vLLM names the
    count once, for every consumer: ``VllmConfig.num_prefill_lookahead_tokens``.
    """
    spec = vllm_config.speculative_config
    if spec is None or not spec.use_eagle():
        return 0
    return max(1, int(getattr(vllm_config, "num_prefill_lookahead_tokens", 1)))
