"""The scheduler-side offload index: which chunks are stored, where, and pinned.

The index owns slots (``0 .. num_chunks-1`` of the first tier), pins (loads
in flight) and in-flight stores; an :class:`EvictionPolicy` only orders the
ready chunks and picks victims. A chunk is in exactly one of three states:

* *storing*: ``prepare_store`` reserved a slot; not loadable, not evictable;
* *ready*: ``complete_store(success=True)`` ran; loadable, evictable unless
  pinned by ``prepare_load``;
* absent (its slot is on the free list).

The index is not thread-safe: the scheduler drives it from one thread.
Hot paths (``lookup``, ``touch``) are a dict probe per key and create no
per-key objects, because the scheduler calls them for every request every
step. Every protocol error is detected on the whole batch *before* anything
changes, so a ``ProtocolError`` leaves the index exactly as it was.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, NoReturn

from kvoffload._checks import checked_int
from kvoffload.errors import ProtocolError
from kvoffload.keys import short_key
from kvoffload.manager._integrity import check_victims
from kvoffload.manager._state import IndexState
from kvoffload.manager._tenants import TenantShares
from kvoffload.manager.policies.admission import AdmissionFilter
from kvoffload.manager.policy import EvictionPolicy, build_policy, nothing_protected
from kvoffload.manager.results import EventKind, IndexEvent, LoadResult, StoreResult
from kvoffload.manager.stats import IndexCounters, IndexStats
from kvoffload.registry import POLICIES

if TYPE_CHECKING:
    from kvoffload.config import OffloadConfig

__all__ = ["OffloadIndex"]

_STORED = EventKind.STORED
_REMOVED = EventKind.REMOVED


#: What a store all of whose keys were turned away (or are there already) reserves.
_NOTHING_STORED = StoreResult((), (), ())


class OffloadIndex(IndexState):
    """Index of offloaded chunks with pins, all-or-nothing stores and events.

    ``policy`` is a registry name (see ``kvoffload.registry.POLICIES``) or an
    :class:`EvictionPolicy` built for ``num_chunks``. With ``record_events``
    false, ``take_events`` always returns ``[]`` (replays need no events and
    should not accumulate them). With ``tenant_share`` (a fraction in
    ``(0, 1]``), no tenant named to ``prepare_store`` holds more than that
    share of the slots (see :mod:`kvoffload.manager._tenants`).
    """

    def __init__(
        self,
        num_chunks: int,
        policy: str | EvictionPolicy | None = None,
        *,
        record_events: bool = True,
        tenant_share: float | None = None,
        write_around: bool = False,
    ) -> None:
        super().__init__(checked_int("num_chunks", num_chunks))
        self.policy = build_policy(policy, num_chunks)
        self.tenants = None if tenant_share is None else TenantShares(num_chunks, tenant_share)
        # Asking a policy without an admission hook per key would only cost time.
        self._filters_admission = type(self.policy).admit is not EvictionPolicy.admit
        self.record_events = record_events
        #: Whether stores the policy's admission turns away are made anyway, for the lower
        #: tiers behind this one: through a slot freed when they complete (``prepare_store``).
        self.write_around = write_around
        self._events: list[IndexEvent] = []
        self._counts = IndexCounters()

    @classmethod
    def from_config(cls, config: OffloadConfig, *, record_events: bool = True) -> OffloadIndex:
        """The index of one worker's CPU tier, as the configuration describes it.

        ``eviction_policy`` picks the policy; a ``store_threshold`` above 1
        wraps it in an :class:`AdmissionFilter` that stores a chunk on that
        many sightings; ``tenant_cpu_share`` caps each tenant's chunks. With a
        disk or remote tier the index writes around (``write_around``): what
        admission turns away still reaches them.
        """
        policy: EvictionPolicy = POLICIES.create(config.eviction_policy, config.num_cpu_chunks)
        if config.store_threshold > 1:
            policy = AdmissionFilter(policy, sightings=config.store_threshold)
        lower = config.disk_path is not None or config.remote_url is not None
        return cls(config.num_cpu_chunks, policy, record_events=record_events,
                   tenant_share=config.tenant_cpu_share, write_around=lower)  # fmt: skip

    # -- queries -------------------------------------------------------------
    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` are ready; the first one that is not stops the count.

        Counts ``hits`` (the ready prefix) and ``misses`` (the rest) and tells
        the policy of the first miss only: chunks after it cannot be used
        without it, so they carry no information of their own.
        """
        ready = self._ready
        n = 0
        for key in keys:
            if key not in ready:
                self.policy.on_miss(key)
                break
            n += 1
        counts = self._counts
        counts.lookups += 1
        counts.hits += n
        counts.misses += len(keys) - n
        return n

    def touch(self, keys: Iterable[bytes]) -> None:
        """Tell the policy ``keys`` were used, in the caller's order; unknown keys are ignored.

        The last key touched is the most recent: a request's keys tail first
        keep its head, which the tail needs, longest (the order
        :mod:`kvoffload.manager.usage` gives; +6.7 points of LRU hit ratio on
        the Claude Code trace at 8,000 chunks).
        """
        self.policy.touch_many(keys)  # it tracks the ready keys, and ignores the others

    def refresh(self, keys: Iterable[bytes]) -> None:
        """Rank ``keys`` recent like ``touch``, but as no hit of this tier (see ``usage``)."""
        self.policy.refresh_many(keys)

    # -- loads ---------------------------------------------------------------
    def prepare_load(self, keys: Sequence[bytes]) -> LoadResult:
        """Pin ready ``keys`` for a load and return their slots.

        Pins stack: a key passed twice (here or in two calls) needs two
        ``complete_load``. Raises ``ProtocolError`` if any key is not ready
        (unknown, or its store is still in flight); nothing is pinned then.
        Does not touch the keys: the caller decides what counts as a use.
        """
        ready = self._ready
        for key in keys:
            if key not in ready:
                state = "still being stored" if key in self._storing else "not stored"
                raise ProtocolError(f"prepare_load: chunk {short_key(key)} is {state}")
        pins, tenants = self._pins, self.tenants
        if tenants is None:
            for key in keys:
                pins[key] = pins.get(key, 0) + 1
        else:
            for key in keys:
                held = pins.get(key, 0)
                pins[key] = held + 1
                if not held:
                    tenants.pinned(key, +1)
        return LoadResult(tuple(keys), tuple([ready[key] for key in keys]))

    def complete_load(self, keys: Sequence[bytes]) -> None:
        """Drop one pin per occurrence of each key; raise ``ProtocolError`` below zero pins."""
        pins, tenants = self._pins, self.tenants
        unique = set(keys)
        if len(unique) < len(keys) or not pins.keys() >= unique:  # else one pin each: enough
            for key, count in Counter(keys).items():
                held = pins.get(key, 0)
                if count > held:
                    raise ProtocolError(
                        f"complete_load: chunk {short_key(key)} has {held} pin(s), "
                        f"asked to drop {count}"
                    )
        for key in keys:
            left = pins[key] - 1
            if left:
                pins[key] = left
            else:
                del pins[key]
                if tenants is not None:
                    tenants.pinned(key, -1)

    # -- stores --------------------------------------------------------------
    def prepare_store(
        self, keys: Sequence[bytes], *, admit_all: bool = False, tenant: str | None = None
    ) -> StoreResult | None:
        """Reserve slots for the missing ``keys``, evicting unprotected ready chunks if needed.

        ``admit_all`` skips the policy's admission (a promotion from a lower
        tier: the chunk already proved worth keeping, and a load depends on it).
        ``tenant`` owns the new chunks; with tenant shares on, a tenant at its
        cap makes room from its own chunks first (``None`` if it cannot).

        With ``write_around`` (a disk or remote tier behind this one), keys
        the policy turns away are reserved too and reported as stored: their
        bytes must pass through a CPU slot to reach the lower tiers, and the
        filter decides only what this tier keeps (their slots are freed when
        the store completes). Without, they are not stored at all.

        Already-ready keys are skipped and protected from this call's
        evictions; in-flight keys and duplicates are skipped. Room is checked
        assuming every missing key is admitted, *before* the policy's
        ``admit`` is asked, so that ``None`` (room cannot be made without
        evicting pinned or protected chunks) changes nothing at all, policy
        and admission state included.
        """
        ready, storing = self._ready, self._storing
        unique = dict.fromkeys(keys)  # each key once, in order
        missing = [key for key in unique if key not in ready and key not in storing]
        found = {key for key in unique if key in ready} if len(missing) < len(unique) else set()
        if len(missing) > len(self._free) + self._evictable(found):
            return None
        tenants = self.tenants
        if tenants is not None and not tenants.fits(tenant, len(missing), found, self._pins):
            return None
        admitted, cold = self._admit(missing) if not admit_all else (missing, [])
        if not admitted and tenants is None:
            return _NOTHING_STORED  # every key turned away (the common store at a full tier)
        evicted: list[bytes] = []
        if tenants is not None:
            own = tenants.over_cap(tenant, len(admitted))
            evicted = self._evict(own, found, tenants.others(tenant))
        capped = len(evicted)
        evicted += self._evict(len(admitted) - len(self._free), found)
        free = self._free
        slots = []
        for key in admitted:
            slot = free.pop()
            storing[key] = slot
            slots.append(slot)
        if tenants is not None:
            tenants.reserve(admitted, tenant)
        self._cold.update(cold)
        return StoreResult(tuple(admitted), tuple(slots), tuple(evicted), capped)

    def _admit(self, missing: list[bytes]) -> tuple[list[bytes], list[bytes]]:
        """The keys of ``missing`` to store, and those of them stored for the lower tiers only."""
        if not self._filters_admission:
            return missing, []
        admitted = self.policy.admit_many(missing)
        self._counts.rejected += len(missing) - len(admitted)
        if not self.write_around or len(admitted) == len(missing):
            return admitted, []
        # Turned away from this tier, not from the ones behind it: stored through a slot
        # like the others, which is freed once the store is done.
        kept = set(admitted)
        return missing, [key for key in missing if key not in kept]

    def complete_store(self, keys: Sequence[bytes], success: bool = True) -> None:
        """Finish in-flight stores: ready and ``STORED`` on success, slots freed otherwise.

        A store made only for the lower tiers (``write_around``) frees its
        slot on success too: the chunk is on them now, and was not admitted here.

        Raises ``ProtocolError`` (changing nothing) if a key is not being
        stored, e.g. completed twice or never prepared. Keys reach the policy's
        ``insert`` in the order given, like ``touch``.
        """
        storing = self._storing
        batch = set(keys)
        if len(batch) != len(keys) or not storing.keys() >= batch:  # at once: the common case
            self._refuse_completion(keys)
        if success and self._cold and not self._cold.isdisjoint(keys):
            around = [key for key in keys if key in self._cold]  # for the lower tiers only
            self._give_back(around)
            self._counts.written_around += len(around)
            keys = [key for key in keys if key in storing]
        if success:
            ready = self._ready
            if self.record_events:
                record = self._events.append
                for key in keys:
                    ready[key] = slot = storing.pop(key)
                    record(IndexEvent(_STORED, key, slot))
            else:
                for key in keys:
                    ready[key] = storing.pop(key)
            self.policy.insert_many(keys)
            self._counts.stores += len(keys)
            if self.tenants is not None:
                self.tenants.stored(keys)
        else:
            self._give_back(keys)
            self._counts.store_failures += len(keys)

    def discard(self, keys: Iterable[bytes]) -> list[bytes]:
        """Drop ready, unpinned ``keys`` (chunks no hit will need); returns those dropped."""
        gone = list(dict.fromkeys(k for k in keys if k in self._ready and k not in self._pins))
        for key in gone:
            self.policy.remove(key)
        self._drop(gone)
        self._counts.removed += len(gone)
        return gone

    # -- housekeeping --------------------------------------------------------
    def take_events(self) -> list[IndexEvent]:
        """Events since the last call, oldest first; the index forgets them."""
        events, self._events = self._events, []
        return events

    def stats(self) -> IndexStats:
        """Counters and occupancy (:class:`IndexStats`); the policy's name is ``policy.name``."""
        ready, storing = len(self._ready), len(self._storing)
        return IndexStats(**self._counts.snapshot(), capacity=self.capacity,
                          used=ready + storing, ready=ready, storing=storing,
                          pinned=len(self._pins), free=len(self._free))  # fmt: skip

    def reset(self) -> None:
        """Drop every ready chunk that is not pinned, with a ``REMOVED`` event each.

        Pinned chunks and in-flight stores survive, so jobs already handed to
        the worker side still complete against valid slots (invariant 2).
        Policy state (ghosts, adaptation) starts over; counters keep counting.
        """
        dropped = [key for key in self._ready if key not in self._pins]
        self._drop(dropped)
        self.policy.reset()
        for key in self._ready:
            self.policy.insert(key)
        self._counts.removed += len(dropped)
        self._counts.resets += 1

    def check_integrity(self) -> None:
        """Raise ``IntegrityError`` with the numbers if the index's state is inconsistent."""
        from kvoffload.manager._integrity import check_index

        check_index(
            self._ready, self._storing, self._pins, self._free, self.capacity, cold=self._cold
        )
        self.policy.check_integrity(self._ready.keys())
        if self.tenants is not None:
            self.tenants.check(self._ready.keys(), self._storing.keys(), self._pins.keys())

    # -- internals -------------------------------------------------------------
    def _give_back(self, keys: Sequence[bytes]) -> None:
        """Free the slots of in-flight ``keys`` that do not become ready here (failed, or
        stored for the lower tiers only)."""
        storing, free = self._storing, self._free
        for key in keys:
            free.append(storing.pop(key))
        self._cold.difference_update(keys)
        if self.tenants is not None:
            self.tenants.dropped(keys, ready=False)

    def _refuse_completion(self, keys: Sequence[bytes]) -> NoReturn:
        """Raise ``complete_store`` 's error, naming the first key with no store in flight."""
        storing, batch = self._storing, set()
        for key in keys:
            if key not in storing or key in batch:
                raise ProtocolError(
                    f"complete_store: chunk {short_key(key)} has no store in flight "
                    "(never prepared, or completed twice)"
                )
            batch.add(key)
        raise AssertionError("complete_store refused keys it can complete")

    def _evict(
        self, need: int, found: set[bytes], spare: Callable[[bytes], bool] | None = None
    ) -> list[bytes]:
        """Have the policy pick ``need`` victims, check them, then free their slots.

        ``spare`` protects more chunks (another tenant's, for a tenant at its cap).
        """
        if need <= 0:
            return []
        pins, ready = self._pins, self._ready
        if spare is None:
            # A set's own membership test, not a lambda: it is asked once per victim.
            kept = (pins.keys() | found).__contains__ if pins or found else nothing_protected
            victims = self.policy.evict(need, kept)
        else:
            victims = self.policy.evict(need, lambda key: key in pins or key in found or spare(key))
        check_victims(self.policy.name, victims, need, ready=ready, pins=pins, found=found)
        self._drop(victims)
        self._counts.evictions += need
        return victims

    def _drop(self, keys: Sequence[bytes]) -> None:
        """Free the slots of ready ``keys`` (the policy already let go of them), with events."""
        free, ready = self._free, self._ready
        if self.record_events:
            record = self._events.append
            for key in keys:
                free.append(slot := ready.pop(key))
                record(IndexEvent(_REMOVED, key, slot))
        else:
            for key in keys:
                free.append(ready.pop(key))
        if self.tenants is not None:
            self.tenants.dropped(keys, ready=True)
