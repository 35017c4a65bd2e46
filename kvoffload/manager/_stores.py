"""How chunks enter the index: stores reserved, completed or aborted.

A store is two calls around the worker's copy: ``prepare_store`` reserves a slot per
chunk (evicting to make room: :mod:`kvoffload.manager._evictions`), and ``complete_store`` makes the
chunks loadable or ``abort_store`` gives their slots back. A promotion (a lower tier's
chunk read into this tier for a load) reserves its slots with ``prepare_promotion``
and completes the same way. Every protocol error is detected on the whole batch
*before* anything changes, so a ``ProtocolError`` leaves the index exactly as it was.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from itertools import filterfalse
from typing import NoReturn

from kvoffload.errors import ProtocolError
from kvoffload.keys import short_key
from kvoffload.manager._evictions import IndexEvictions
from kvoffload.manager._tenants import TenantShares
from kvoffload.manager.policy import EvictionPolicy
from kvoffload.manager.results import EventKind, IndexEvent, Steer, StoreResult

__all__ = ["IndexStores"]

_STORED = EventKind.STORED

#: What a store all of whose keys were turned away (or are there already) reserves.
_NOTHING_STORED = StoreResult((), (), ())
_NO_KEYS: frozenset[bytes] = frozenset()

#: What a store tells of its chunks' parents (``prepare_store``): a parent per key, or
#: whether they are one chain's consecutive chunks, and the chunk before them.
Links = tuple[Sequence[bytes | None] | None, bool, bytes | None]

#: Which of a store's missing keys this tier keeps, and which it stores for the lower
#: tiers only (write-around): the policy's admission, or none for a promotion.
Admission = Callable[[list[bytes]], tuple[list[bytes], list[bytes]]]


def _admit_every(missing: list[bytes]) -> tuple[list[bytes], list[bytes]]:
    return missing, []


class IndexStores(IndexEvictions):
    """Slot reservations for stores and promotions, and their completion."""

    def __init__(
        self,
        capacity: int,
        policy: EvictionPolicy,
        *,
        tenants: TenantShares | None,
        record_events: bool,
        write_around: bool,
    ) -> None:
        super().__init__(capacity, policy, tenants=tenants, record_events=record_events)
        # Asking a policy without an admission hook per key would only cost time.
        self._filters_admission = type(policy).admit is not EvictionPolicy.admit
        #: Whether stores the policy's admission turns away are made anyway, for the lower
        #: tiers behind this one: through a slot freed when they complete (``prepare_store``).
        self.write_around = write_around
        #: Where the last ``lookup`` stopped: its first missing key and the chunk before it.
        self._after: tuple[bytes, bytes] | None = None

    def prepare_store(
        self,
        keys: Sequence[bytes],
        *,
        tenant: str | None = None,
        parents: Sequence[bytes | None] | None = None,
        chain: bool = False,
        after: bytes | None = None,
        steer: Steer | None = None,
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

        The chunks reserved are linked to their parents at once, for prefix
        order (:mod:`kvoffload.manager._chains`), where the caller says what
        they are: ``parents[i]`` is ``keys[i]`` 's parent in its full-prefix
        chain (``None``: a head, a window chunk or a state); or, with
        ``chain``, ``keys`` are consecutive chunks of one chain after
        ``after`` (``None``: from its head), a plain layout's step. Without
        either, the chunk the last ``lookup`` stopped after is the parent of
        a store that starts where it stopped.

        ``steer``: a client's retention hint for some of ``keys`` (:class:`Steer`): its
        ``keep`` keys are admitted whatever the policy's admission says, its ``drop`` keys
        are turned away from this tier as admission's rejects are.
        """
        if parents is not None and (chain or len(parents) != len(keys)):
            raise ProtocolError(
                f"prepare_store: {len(keys)} key(s), {len(parents)} parent(s)"
                + (" and chain=True" if chain else "")
            )
        admit = self._admit if steer is None else functools.partial(self._steered, steer)
        return self._reserve(keys, tenant, admit, (parents, chain, after))

    def prepare_promotion(
        self, keys: Sequence[bytes], *, tenant: str | None = None
    ) -> StoreResult | None:
        """:meth:`prepare_store` for chunks read in from a lower tier, past the policy's
        admission: such a chunk already proved worth keeping, and a load depends on it."""
        return self._reserve(keys, tenant, _admit_every)

    def _reserve(
        self,
        keys: Sequence[bytes],
        tenant: str | None,
        admit: Admission,
        links: Links = (None, False, None),
    ) -> StoreResult | None:
        ready, storing = self._ready, self._storing
        unique = dict.fromkeys(keys)  # each key once, in order
        # Neither ready nor in flight, at C speed (a store of every step of every request).
        missing = list(filterfalse(storing.__contains__, filterfalse(ready.__contains__, unique)))
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
        memo = self._after
        if links[0] is None and not links[1] and memo is not None and admitted[0] == memo[0]:
            keys, links = admitted[:1], (None, True, memo[1])  # it goes on from the lookup's
        free = self._free
        if len(admitted) > len(free) or tenants is not None:
            evicted, capped = self._make_room(admitted, found, tenant, keys, links)
        else:
            evicted, capped = [], 0
        if admitted:  # the last slots freed first, as pops take them; at C speed
            n = len(admitted)
            slots = free[: -n - 1 : -1]
            del free[-n:]
            storing.update(zip(admitted, slots, strict=True))
            deque(map(self._chains.key_of.__setitem__, slots, admitted), 0)
            self._link_reserved(keys, admitted, slots, links)
        else:
            slots = []
        if tenants is not None:
            tenants.reserve(admitted, tenant)
        self._cold.update(cold)
        return StoreResult(tuple(admitted), tuple(slots), tuple(evicted), capped)

    def _link_reserved(
        self, keys: Sequence[bytes], admitted: list[bytes], slots: list[int], links: Links
    ) -> None:
        """Link the chunks just reserved (``admitted``, of ``keys``, in ``slots``): their
        parents, present, are no leaves while they are copied."""
        chains = self._chains
        # No orphan waits for these chunks (at C speed): they have no child.
        fresh = not chains.waiting or chains.waiting.keys().isdisjoint(admitted)
        if not fresh:  # a chunk back in the tier makes its children reachable
            chains.arrive(admitted, slots)
        parents, chain, after = links
        if chain and len(admitted) == len(keys):  # a plain step's run, all of it new
            if len(admitted) > 1:
                chains.link_run(admitted, slots, after, fresh)
            elif after is not None:
                chains.link_new(admitted, slots, [after])
            return
        if chain:  # each one's parent: the one before it in keys
            parents = [after, *keys[:-1]]
        if parents is not None:
            if len(keys) != len(admitted):  # admission turned some away, or some were there
                parent_of = dict(zip(keys, parents, strict=True))
                parents = [parent_of.get(key) for key in admitted]
            chains.link_new(admitted, slots, parents, fresh=fresh)

    def _make_room(
        self,
        admitted: list[bytes],
        found: set[bytes],
        tenant: str | None,
        keys: Sequence[bytes],
        links: Links,
    ) -> tuple[list[bytes], int]:
        """Evict for ``admitted``: the victims, and how many went for the tenant's cap.

        The parents of the store's chunks (``keys``) are no leaves while it runs."""
        tenants = self.tenants
        keep = _NO_KEYS if self._takes_back else self._chains_kept(keys, links)
        evicted: list[bytes] = []
        if tenants is not None:
            own = tenants.over_cap(tenant, len(admitted))
            evicted = self._evict(own, found, tenants.others(tenant), keep)
        capped = len(evicted)
        evicted += self._evict(len(admitted) - len(self._free), found, keep=keep)
        return evicted, capped

    def _chains_kept(self, keys: Sequence[bytes], links: Links) -> AbstractSet[bytes]:
        """The ready parents of a store's ``keys`` that are not among them."""
        parents, chain, after = links
        if chain:  # the others' parents are the store's own chunks
            return {after} if after is not None and after in self._ready else _NO_KEYS
        if parents is None:
            return _NO_KEYS
        outside = set(parents)  # at C speed: the few that remain are checked one by one
        outside.difference_update(keys)
        ready = self._ready
        return {p for p in outside if p is not None and p in ready}

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

    def _steered(self, steer: Steer, missing: list[bytes]) -> tuple[list[bytes], list[bytes]]:
        """:meth:`_admit` with a client's hint: kept keys pass, dropped ones are turned away
        as admission's rejects are, and the policy's admission is asked about the rest."""
        keep, drop = steer
        asked = [key for key in missing if key not in keep and key not in drop]
        passed = set(self.policy.admit_many(asked)) if self._filters_admission else set(asked)
        admitted: list[bytes] = []
        cold: list[bytes] = []
        for key in missing:
            if key in keep or key in passed:
                admitted.append(key)
            elif self.write_around:  # for the lower tiers only, through a slot
                admitted.append(key)
                cold.append(key)
        self._counts.rejected += len(missing) - len(admitted) + len(cold)
        return admitted, cold

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
        else:  # at C speed: every store completes here
            ready.update(zip(keys, map(storing.pop, keys), strict=True))
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
        self._chains.leave(keys, list(map(storing.__getitem__, keys)))  # first: still there
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
