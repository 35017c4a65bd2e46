"""How chunks enter and leave the index: stores reserved, completed or aborted, evictions.

A store is two calls around the worker's copy: ``prepare_store`` reserves a slot per
chunk (evicting what the policy picks to make room), and ``complete_store`` makes the
chunks loadable or ``abort_store`` gives their slots back. A promotion (a lower tier's
chunk read into this tier for a load) reserves its slots with ``prepare_promotion``
and completes the same way. Every protocol error is detected on the whole batch
*before* anything changes, so a ``ProtocolError`` leaves the index exactly as it was.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import NoReturn

from kvoffload.errors import ProtocolError
from kvoffload.keys import short_key
from kvoffload.manager._integrity import check_victims
from kvoffload.manager._state import IndexState
from kvoffload.manager._tenants import TenantShares
from kvoffload.manager.policy import EvictionPolicy, nothing_protected
from kvoffload.manager.results import EventKind, IndexEvent, StoreResult
from kvoffload.manager.stats import IndexCounters

__all__ = ["IndexStores"]

_STORED = EventKind.STORED
_REMOVED = EventKind.REMOVED

#: What a store all of whose keys were turned away (or are there already) reserves.
_NOTHING_STORED = StoreResult((), (), ())

#: Which of a store's missing keys this tier keeps, and which it stores for the lower
#: tiers only (write-around): the policy's admission, or none for a promotion.
Admission = Callable[[list[bytes]], tuple[list[bytes], list[bytes]]]


def _admit_every(missing: list[bytes]) -> tuple[list[bytes], list[bytes]]:
    return missing, []


def _kept_or_held(kept: Callable[[bytes], bool], held: dict[bytes, int], key: bytes) -> bool:
    return key in held or kept(key)


class IndexStores(IndexState):
    """Slot reservations for stores and promotions, their completion, and evictions."""

    def __init__(
        self,
        capacity: int,
        policy: EvictionPolicy,
        *,
        tenants: TenantShares | None,
        record_events: bool,
        write_around: bool,
    ) -> None:
        super().__init__(capacity)
        self.policy = policy
        self.tenants = tenants
        # Asking a policy without an admission hook per key would only cost time.
        self._filters_admission = type(policy).admit is not EvictionPolicy.admit
        self.record_events = record_events
        #: Whether stores the policy's admission turns away are made anyway, for the lower
        #: tiers behind this one: through a slot freed when they complete (``prepare_store``).
        self.write_around = write_around
        self._events: list[IndexEvent] = []
        self._counts = IndexCounters()

    def prepare_store(
        self, keys: Sequence[bytes], *, tenant: str | None = None
    ) -> StoreResult | None:
        """Reserve slots for the missing ``keys``, evicting unprotected ready chunks if needed.

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
        return self._reserve(keys, tenant, self._admit)

    def prepare_promotion(
        self, keys: Sequence[bytes], *, tenant: str | None = None
    ) -> StoreResult | None:
        """:meth:`prepare_store` for chunks read in from a lower tier, past the policy's
        admission: such a chunk already proved worth keeping, and a load depends on it."""
        return self._reserve(keys, tenant, _admit_every)

    def _reserve(
        self, keys: Sequence[bytes], tenant: str | None, admit: Admission
    ) -> StoreResult | None:
        ready, storing = self._ready, self._storing
        unique = dict.fromkeys(keys)  # each key once, in order
        missing = [key for key in unique if key not in ready and key not in storing]
        found = {key for key in unique if key in ready} if len(missing) < len(unique) else set()
        short = len(missing) - len(self._free) - self._evictable(found)
        if short > 0:
            if short > len(self._held):
                return None
            self._spill(short)
        tenants = self.tenants
        if tenants is not None and not tenants.fits(tenant, len(missing), found, self._pins):
            return None
        admitted, cold = admit(missing)
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

    def _spill(self, n: int) -> None:
        """Let go of the ``n`` newest holds of queued requests, for a store that needs the room:
        each makes one more chunk evictable (or ends counting a pinned one twice)."""
        held = self._held
        for key in list(held)[-n:]:
            del held[key]
        self._counts.spilled += n

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

    def complete_store(self, keys: Sequence[bytes]) -> None:
        """Finish in-flight stores that succeeded: the chunks are ready, with a ``STORED`` event.

        A store made only for the lower tiers (``write_around``) frees its
        slot instead: the chunk is on them now, and was not admitted here.

        Raises ``ProtocolError`` (changing nothing) if a key is not being
        stored, e.g. completed twice or never prepared. Keys reach the policy's
        ``insert`` in the order given, like ``touch``.
        """
        storing = self._check_in_flight(keys, "complete_store")
        if self._cold and not self._cold.isdisjoint(keys):
            around = [key for key in keys if key in self._cold]  # for the lower tiers only
            self._give_back(around)
            self._counts.written_around += len(around)
            keys = [key for key in keys if key in storing]
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

    def abort_store(self, keys: Sequence[bytes]) -> None:
        """Finish in-flight stores that failed: their slots are free again, nothing is stored.

        Raises ``ProtocolError`` (changing nothing) as :meth:`complete_store` does.
        """
        self._check_in_flight(keys, "abort_store")
        self._give_back(keys)
        self._counts.store_failures += len(keys)

    def _check_in_flight(self, keys: Sequence[bytes], call: str) -> dict[bytes, int]:
        """The in-flight stores, once every one of ``keys`` is among them, each once."""
        storing = self._storing
        batch = set(keys)
        if len(batch) != len(keys) or not storing.keys() >= batch:  # at once: the common case
            self._refuse_completion(keys, call)
        return storing

    def _give_back(self, keys: Sequence[bytes]) -> None:
        """Free the slots of in-flight ``keys`` that do not become ready here (failed, or
        stored for the lower tiers only)."""
        storing, free = self._storing, self._free
        for key in keys:
            free.append(storing.pop(key))
        self._cold.difference_update(keys)
        if self.tenants is not None:
            self.tenants.dropped(keys, ready=False)

    def _refuse_completion(self, keys: Sequence[bytes], call: str) -> NoReturn:
        """Raise the error of ``call``, naming the first key with no store in flight."""
        storing, batch = self._storing, set()
        for key in keys:
            if key not in storing or key in batch:
                raise ProtocolError(
                    f"{call}: chunk {short_key(key)} has no store in flight "
                    "(never prepared, or completed twice)"
                )
            batch.add(key)
        raise AssertionError(f"{call} refused keys it can complete")

    def _evict(
        self, need: int, found: set[bytes], spare: Callable[[bytes], bool] | None = None
    ) -> list[bytes]:
        """Have the policy pick ``need`` victims, check them, then free their slots.

        ``spare`` protects more chunks (another tenant's, for a tenant at its cap).
        """
        if need <= 0:
            return []
        pins, ready, held = self._pins, self._ready, self._held
        if spare is None:
            # A set's own membership test, not a lambda: it is asked once per victim.
            kept = (pins.keys() | found).__contains__ if pins or found else nothing_protected
            if held:  # passed over too, asked after the few pinned and found ones
                kept = functools.partial(_kept_or_held, kept, held)
            victims = self.policy.evict(need, kept)
        else:
            victims = self.policy.evict(
                need, lambda key: key in pins or key in found or key in held or spare(key)
            )
        check_victims(
            self.policy.name, victims, need, ready=ready, pins=pins, found=found, held=held
        )
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
