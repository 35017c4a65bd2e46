"""The lower tiers a validated configuration describes, for each side of a connector.

The worker side gets the tiers themselves (:func:`lower_tiers`, in cascade
order: disk, then remote behind its write-behind queue); the scheduler side
gets probes of the same tiers (:func:`lower_probes`), which only answer which
chunks are probably there:
the disk tier's files, the remote server through a connection of its own.
With tensor parallelism each rank of a sharded layout holds its own shard of
every chunk, so the scheduler side asks every rank's namespace
(:func:`rank_probes`). A replicated layout (every group the same on every
rank: an MLA model) has one namespace for all ranks: one copy of a chunk,
which the ranks write in turns (:class:`TakingTurns`) and all read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvoffload.registry import TIERS
from kvoffload.tiers._write_behind import WriteBehind
from kvoffload.tiers.base import ChunkBuffer, Tier, TierProbe, WrappedTier
from kvoffload.tiers.stats import TierStats

if TYPE_CHECKING:
    from kvoffload.config import OffloadConfig

__all__ = [
    "AllRanksProbe",
    "TakingTurns",
    "lower_probes",
    "lower_tiers",
    "rank_probes",
    "remote_tier",
]


def remote_tier(config: OffloadConfig, namespace: bytes) -> Tier:
    """The remote tier of ``namespace`` as ``config`` sets it up (a connection of its own)."""
    tier: Tier = TIERS.create(
        "redis",
        config.remote_url,
        namespace,
        password_env=config.remote_password_env,
        timeout_ms=config.remote_timeout_ms,
        retry_ms=config.remote_retry_ms,
    )
    return tier


def lower_tiers(
    config: OffloadConfig, namespace: bytes, *, rank: int = 0, ranks: int = 1
) -> list[Tier]:
    """Disk (if ``disk_path``), then remote (if ``remote_url``), for ``namespace``.

    ``ranks`` > 1 ranks sharing ``namespace`` (a replicated layout) write in
    turns: this one, ``rank``, only the keys of its turn (:class:`TakingTurns`).

    Every rank's disk tier gets the whole ``disk_bytes_to_use``: it is the
    budget of the directory, which the ranks (each in its own namespace
    directory) and any other process on the path share through one index, so
    they stay within it together (unlike ``cpu_bytes_to_use``, divided
    between ranks because each holds its own slab). The remote tier comes
    wrapped in a :class:`WriteBehind` queue of ``remote_queue_bytes``, so store
    jobs never wait for the network.
    """
    tiers: list[Tier] = []
    if config.disk_path is not None:
        tiers.append(TIERS.create("disk", config.disk_path, config.disk_bytes_to_use, namespace))
    if config.remote_url is not None:
        tiers.append(WriteBehind(remote_tier(config, namespace), config.remote_queue_bytes))
    if ranks > 1:
        return [TakingTurns(tier, rank, ranks) for tier in tiers]
    return tiers


def lower_probes(config: OffloadConfig, namespace: bytes) -> list[TierProbe]:
    """What the scheduler side asks instead of :func:`lower_tiers`, in the same order."""
    from kvoffload.tiers.disk import DiskProbe

    probes: list[TierProbe] = []
    if config.disk_path is not None:
        probes.append(DiskProbe(config.disk_path, namespace))
    if config.remote_url is not None:
        probes.append(remote_tier(config, namespace))
    return probes


class AllRanksProbe:
    """One tier on every tensor-parallel rank: a chunk is loadable only if each holds its shard."""

    def __init__(self, probes: Sequence[TierProbe]) -> None:
        self._probes = tuple(probes)
        self.name = probes[0].name

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        answers = [probe.contains_many(keys) for probe in self._probes]
        return [all(column) for column in zip(*answers, strict=True)]

    def close(self) -> None:
        for probe in self._probes:
            probe.close()


class TakingTurns(WrappedTier):
    """A lower tier that ``ranks`` ranks share for chunks they hold alike, written in turns.

    Every rank of a replicated layout runs every store with the same bytes
    under the same key; this rank writes only the keys of its turn (the
    key's last byte modulo ``ranks``), so each chunk is written once and the
    writes spread over the ranks' threads. Reads, probes and discards go to
    the tier. A rank that dies mid-write leaves no chunk another would load:
    the disk tier renames a whole, checksummed file into place, the remote
    tier sets a whole, checksummed record; and the scheduler records a store
    only once every rank, the writer included, reported it.
    """

    def __init__(self, tier: Tier, rank: int, ranks: int) -> None:
        super().__init__(tier)
        self.rank, self.ranks = rank, ranks
        #: Stores left to the rank whose turn they were.
        self.others_turns = 0

    def turn(self, key: bytes) -> int:
        """The rank that writes ``key``."""
        return key[-1] % self.ranks

    def put(self, key: bytes, data: ChunkBuffer) -> None:
        if self.turn(key) == self.rank:
            self.tier.put(key, data)
        else:
            self.others_turns += 1

    def stats(self) -> TierStats:
        return self.tier.stats()

    def close(self) -> None:
        self.tier.close()


def rank_probes(config: OffloadConfig, namespaces: Sequence[bytes]) -> list[TierProbe]:
    """The lower tiers as one scheduler sees them over ranks with ``namespaces``, in order.

    Ranks that share a namespace (a replicated layout) share its chunks: one probe.
    """
    namespaces = list(dict.fromkeys(namespaces))
    per_rank = [lower_probes(config, namespace) for namespace in namespaces]
    if len(per_rank) == 1:
        return per_rank[0]
    return [AllRanksProbe(tier) for tier in zip(*per_rank, strict=True)]
