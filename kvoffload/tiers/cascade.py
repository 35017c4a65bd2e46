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

**Write-behind to network tiers.** A tier with ``write_behind`` (the remote
tier) is not written inside the job: a server that is slow would hold the
engine's few worker threads, and loads queue behind them. The job copies the
chunk out of its slot instead (``Tier.stage_put``; once the job is done the
slot may be evicted and reused, so nothing reads it afterwards) into a
bounded queue that one thread per tier drains (:mod:`kvoffload.tiers._write_behind`).
A store the queue refuses (full at ``write_behind_bytes``, or the server known
to be down) fails in the job: counted, and named in the job's errors. A write
that fails later is counted in that tier's figures and the traffic here, and
logged once per run of failures; it can no longer be named by a job, which has
finished. Either way the chunk stays in CPU and nothing blocks. :meth:`drain`
waits for the queues (tests, shutdown); :meth:`close` drains before it closes.

**Promotion.** A load whose chunk is not in its CPU slot reads it from the
first lower tier that has it *into that slot* (verified by the tier), binds
it there and scatters from it: the slot given by the index's
``prepare_store`` for the promoted key is both the staging buffer and the
chunk's new CPU home, so a disk hit costs one disk read and one scatter.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvoffload.config.offload_config import OffloadConfig
from kvoffload.errors import ConfigError, KVOffloadError, TierError
from kvoffload.tiers._write_behind import WriteBehind
from kvoffload.tiers.base import Tier
from kvoffload.tiers.cpu import CPUTier

__all__ = ["TierCascade", "TierTraffic"]


@dataclass(slots=True)
class TierTraffic:
    """Bytes and seconds a tier moved, for hit reports and GB/s."""

    stores: int = 0
    store_bytes: int = 0
    store_seconds: float = 0.0
    store_failures: int = 0
    loads: int = 0
    load_bytes: int = 0
    load_seconds: float = 0.0
    load_failures: int = 0

    @property
    def store_gbps(self) -> float:
        return self.store_bytes / self.store_seconds / 1e9 if self.store_seconds else 0.0

    @property
    def load_gbps(self) -> float:
        return self.load_bytes / self.load_seconds / 1e9 if self.load_seconds else 0.0

    def add(self, store: bool, nbytes: int, seconds: float, ok: bool = True) -> None:
        if store:
            self.stores += ok
            self.store_bytes += nbytes if ok else 0
            self.store_seconds += seconds
            self.store_failures += not ok
        else:
            self.loads += ok
            self.load_bytes += nbytes if ok else 0
            self.load_seconds += seconds
            self.load_failures += not ok


class TierCascade:
    """The CPU tier plus lower tiers, in order; see the module docstring.

    Traffic counters are updated by the engine's worker threads; each update
    is a handful of integer adds under the GIL, and reports read them only
    after the jobs they describe finished.
    """

    def __init__(
        self,
        cpu: CPUTier,
        lower: Sequence[Tier] = (),
        *,
        write_behind_bytes: int = OffloadConfig.remote_queue_bytes,
    ) -> None:
        self.cpu = cpu
        self.lower = tuple(lower)
        names = [tier.name for tier in self.tiers]
        if not all(names) or len(set(names)) != len(names):
            # Traffic and stats are keyed by name: an empty or repeated one would merge counters.
            raise ConfigError(f"every tier of a cascade needs its own non-empty name, got {names}")
        self.traffic = {name: TierTraffic() for name in names}
        self._behind = {
            tier.name: WriteBehind(tier, write_behind_bytes, self._reporter(tier.name))
            for tier in self.lower
            if tier.write_behind
        }

    def _reporter(self, name: str) -> Callable[[bool, int, float], None]:
        traffic = self.traffic[name]
        return lambda ok, nbytes, seconds: traffic.add(True, nbytes, seconds, ok=ok)

    @property
    def tiers(self) -> tuple[Tier, ...]:
        return (self.cpu, *self.lower)

    def write_through(self, key: bytes, slot: int, nbytes: int) -> list[str]:
        """Copy the chunk in ``slot`` to every lower tier (write-behind ones: queue it).

        Returns one message per failure known now; see the module docstring.
        """
        errors = []
        data = self.cpu.slot_array(slot, nbytes)
        for tier in self.lower:
            behind = self._behind.get(tier.name)
            if behind is not None:
                try:
                    behind.submit(key, data)  # counted in traffic by the queue, refusals too
                except KVOffloadError as exc:
                    errors.append(f"{tier.name}: {exc}")
                continue
            start = time.perf_counter()
            try:
                tier.put(key, data)
            except KVOffloadError as exc:
                errors.append(f"{tier.name}: {exc}")
                self.traffic[tier.name].add(True, nbytes, time.perf_counter() - start, ok=False)
            else:
                self.traffic[tier.name].add(True, nbytes, time.perf_counter() - start)
        return errors

    def fill(
        self, key: bytes, slot: int, nbytes: int, errors: list[str] | None = None
    ) -> Tier | None:
        """Make ``slot`` hold ``key``: return the tier it came from, ``None`` if none has it.

        Already in the slot: the CPU tier. Otherwise the first lower tier that
        loads it (verified) into the slot, which is then bound (promotion).
        A lower tier that fails is counted, its message appended to
        ``errors`` (``"disk: ..."``), and the next one is tried.
        """
        if self.cpu.holds(key, slot):
            return self.cpu
        self.cpu.reserve(slot)
        out = self.cpu.slot_array(slot, nbytes)
        for tier in self.lower:
            if tier.cheap_contains and not tier.contains(key):
                continue
            start = time.perf_counter()
            try:
                tier.get_into(key, out)
            except TierError as exc:
                self.traffic[tier.name].add(False, nbytes, time.perf_counter() - start, ok=False)
                if errors is not None:
                    errors.append(f"{tier.name}: {exc}")
                continue
            self.traffic[tier.name].add(False, nbytes, time.perf_counter() - start)
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

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every queued write-behind store finished; ``False`` on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for behind in self._behind.values():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not behind.drain(left):
                return False
        return True

    def stats(self) -> dict[str, dict[str, object]]:
        """Per tier: the tier's own counters (plus ``write_behind``, its queue's, if it has one)."""
        stats = {tier.name: tier.stats() for tier in self.tiers}
        for name, behind in self._behind.items():
            stats[name]["write_behind"] = behind.stats()
        return stats

    def check_integrity(self) -> None:
        for tier in self.tiers:
            tier.check_integrity()

    def close(self) -> None:
        """Finish queued write-behind stores (bounded by their timeouts), then close every tier."""
        for behind in self._behind.values():
            behind.close()
        for tier in self.tiers:
            tier.close()
