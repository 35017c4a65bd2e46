"""The tier cascade: the CPU slab first, then lower tiers (disk, a shared store).

**Write-through to local tiers.** A store lands in its CPU slot and is then
written, from that same slot, to every local lower tier (disk) before the
store job finishes. Why not write-back (write a chunk down only when the
index evicts it from CPU)?

* The index evicts inside ``prepare_store``, on the scheduler's critical
  path, and the evicted slot is overwritten right away by the new store; a
  write-back would have to finish a disk write of the victim first, making
  every store under memory pressure wait on the disk.
* The write reads the slot while the index still pins it (the store is in
  flight), so invariant 2 holds with no extra copy and no extra pin protocol;
  a slot is never overwritten under a pending write.
* Lower tiers survive the process: with write-through a restart finds every
  chunk the CPU tier ever held (warm restart by namespace), and a crash loses
  nothing that was reported stored.

The price is store latency (the job holds the engine's blocks until the
lower tiers have the chunk) and lower-tier bandwidth for chunks that might
never be evicted; both are off the forward pass. A failed lower-tier write
does not fail the store (the chunk is in CPU, invariant 1 holds); it is
counted and returned so the job result names it.

**Write-behind to network tiers.** The remote tier is not written inside the
job: a server that is slow would hold the engine's few worker threads, and
loads queue behind them. It sits in this cascade wrapped in a
:class:`~kvoffload.tiers._write_behind.WriteBehind` queue (as
:func:`kvoffload.tiers.from_config.lower_tiers` builds it), whose ``put`` copies
the chunk out of its slot (once the job is done the slot may be evicted and
reused, so nothing reads it afterwards) and returns; one thread per queue
writes it. The cascade itself knows nothing of this: every lower tier is a
:class:`~kvoffload.tiers.base.Tier`. A store the queue refuses (full at
``remote_queue_bytes``, or the server known to be down) fails in the job:
counted, and named in the job's errors. A write that fails later is counted in
that tier's stats and logged once per run of failures; it can no longer be
named by a job, which has finished. Either way the chunk stays in CPU and
nothing blocks; :meth:`close` lets each queue finish before it closes.

**Counting.** Each tier counts its own events (:mod:`kvoffload.tiers.stats`);
the cascade counts nothing. :meth:`stats` collects one record per tier.

**Promotion.** A load whose chunk is not in its CPU slot reads it from the
first lower tier that has it *into that slot* (verified by the tier), binds
it there and scatters from it: the slot given by the index's
``prepare_store`` for the promoted key is both the staging buffer and the
chunk's new CPU home, so a disk hit costs one disk read and one scatter.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvoffload.errors import ConfigError, KVOffloadError, TierError
from kvoffload.tiers.base import Tier
from kvoffload.tiers.cpu import CPUSlab
from kvoffload.tiers.stats import TierStats

__all__ = ["TierCascade"]


class TierCascade:
    """The CPU slab plus lower tiers, in order; see the module docstring."""

    def __init__(self, cpu: CPUSlab, lower: Sequence[Tier] = ()) -> None:
        self.cpu = cpu
        self.lower = tuple(lower)
        names = [cpu.name, *(tier.name for tier in self.lower)]
        if not all(names) or len(set(names)) != len(names):
            # Stats are keyed by name: an empty or repeated one would hide a tier's figures.
            raise ConfigError(f"every tier of a cascade needs its own non-empty name, got {names}")

    def write_through(self, key: bytes, slot: int, nbytes: int) -> list[str]:
        """Copy the chunk in ``slot`` to every lower tier (a write-behind one queues it).

        Returns one message per failure known now; see the module docstring.
        """
        errors = []
        data = self.cpu.slot_array(slot, nbytes)
        for tier in self.lower:
            try:
                tier.put(key, data)
            except KVOffloadError as exc:
                errors.append(f"{tier.name}: {exc}")
        return errors

    def fill(
        self, key: bytes, slot: int, nbytes: int, errors: list[str] | None = None
    ) -> Tier | CPUSlab | None:
        """Make ``slot`` hold ``key``: return the tier it came from, ``None`` if none has it.

        Already in the slot: the CPU slab. Otherwise the first lower tier that
        loads it (verified) into the slot, which is then bound (promotion).
        A lower tier that fails has its message appended to ``errors``
        (``"disk: ..."``), and the next one is tried; one that misses is
        skipped silently.
        """
        if self.cpu.holds(key, slot):
            return self.cpu
        self.cpu.counters.add(misses=1)
        self.cpu.reserve(slot)
        out = self.cpu.slot_array(slot, nbytes)
        for tier in self.lower:
            try:
                found = tier.get_into(key, out)
            except TierError as exc:
                if errors is not None:
                    errors.append(f"{tier.name}: {exc}")
                continue
            if found:
                self.cpu.bind(key, slot, nbytes)
                return tier
        self.cpu.release(slot)
        return None

    def lower_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` some lower tier probably holds.

        Each tier is asked once, in one batch (``contains_many``: one round
        trip for a remote tier), and only about the keys the tiers before it
        lack, so a request's lookup costs one question per tier.
        """
        found = [False] * len(keys)
        wanted = list(range(len(keys)))
        for tier in self.lower:
            if not wanted:
                break
            answers = tier.contains_many([keys[i] for i in wanted])
            for i, yes in zip(wanted, answers, strict=True):
                found[i] = yes
            wanted = [i for i, yes in zip(wanted, answers, strict=True) if not yes]
        return next((i for i, yes in enumerate(found) if not yes), len(keys))

    def stats(self) -> dict[str, TierStats]:
        """One stats record per tier, by name, in cascade order (the CPU slab first)."""
        return {self.cpu.name: self.cpu.stats(), **{t.name: t.stats() for t in self.lower}}

    def check_integrity(self) -> None:
        self.cpu.check_integrity()
        for tier in self.lower:
            tier.check_integrity()

    def close(self) -> None:
        """Close every lower tier (a write-behind one finishes its queue first), then the slab."""
        for tier in self.lower:
            tier.close()
        self.cpu.close()
