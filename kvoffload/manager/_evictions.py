"""How chunks leave the index: evictions in prefix order, and the slots they free.

An eviction frees the slots a store needs from ready chunks no pin, hold or the store
itself protects, in three passes (:meth:`IndexEvictions._evict`): orphans first (chunks
whose parent left the CPU tier, oldest first: no hit reaches them through this tier),
then the policy's choice among the leaves of the chains (chunks with no child present:
a chain loses its tail before its head, whatever the policy ranks first), and only if
those cannot give the room, the policy's plain choice (a protected leaf blocks its
ancestors; ``prepare_store`` promised the room). The links are
:mod:`kvoffload.manager._chains`.

How the leaves are found depends on the policy (:mod:`kvoffload.manager.policy`). One
that takes a victim back (``takes_back``: LRU, segmented LRU and so the adaptive
policy) is asked plainly, and the victims that turn out parents as they leave (a
subtraction and a pass at C speed: :meth:`~kvoffload.manager._chains.Chains.leave`)
are given back, ranked newest, and replaced; under the usage rules of
:mod:`kvoffload.manager.usage` LRU's oldest chunk is a leaf, so that happens only
where a pin, a hold or a store protected a child. Any other policy is asked about
each candidate (:meth:`~kvoffload.manager._chains.Chains.leaf_guard`), and the
parents of the store's own chunks count as parents already.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Collection, Sequence
from collections.abc import Set as AbstractSet

from kvoffload.manager._chains import Chains
from kvoffload.manager._integrity import check_victims
from kvoffload.manager._state import IndexState
from kvoffload.manager._tenants import TenantShares
from kvoffload.manager.policy import EvictionPolicy, nothing_protected
from kvoffload.manager.results import EventKind, IndexEvent
from kvoffload.manager.stats import IndexCounters

__all__ = ["IndexEvictions"]

_REMOVED = EventKind.REMOVED
_NO_KEYS: frozenset[bytes] = frozenset()


def _kept_or_held(kept: Callable[[bytes], bool], held: dict[bytes, int], key: bytes) -> bool:
    return key in held or kept(key)


class IndexEvictions(IndexState):
    """The index's policy, chains and counters, and the evictions that use them."""

    def __init__(
        self,
        capacity: int,
        policy: EvictionPolicy,
        *,
        tenants: TenantShares | None,
        record_events: bool,
    ) -> None:
        super().__init__(capacity)
        self.policy = policy
        self.tenants = tenants
        self.record_events = record_events
        self._events: list[IndexEvent] = []
        self._counts = IndexCounters()
        self._chains = Chains(capacity, self._ready, self._storing)
        #: Whether the policy takes a victim back (``takes_back``): its choice, checked.
        self._takes_back = policy.takes_back

    def _evict(
        self,
        need: int,
        found: set[bytes],
        spare: Callable[[bytes], bool] | None = None,
        keep: AbstractSet[bytes] = _NO_KEYS,
    ) -> list[bytes]:
        """Free ``need`` slots of unprotected ready chunks, keeping prefix order.

        Orphans go first (:mod:`kvoffload.manager._chains`), then what the policy
        picks among the leaves (chunks with no child present, nor in ``keep``: the
        parents of the store's chunks); only if those cannot give the room does the
        policy pick from the rest. Every victim is checked before its slot is freed.
        ``spare`` protects more chunks (another tenant's, for a tenant at its cap).
        """
        if need <= 0:
            return []
        pins, held = self._pins, self._held
        if spare is not None or held:
            kept = self._protection(found, spare)
        else:  # a set's own membership test, not a lambda: it is asked once per victim
            kept = (pins.keys() | found).__contains__ if pins or found else nothing_protected
        chains = self._chains
        victims = self._evict_orphans(need, kept, found) if chains.orphans else []
        rest = need - len(victims)
        if rest:
            if self._takes_back:  # its choice, checked as it leaves
                victims += self._take_in_order(rest, kept, found)
                self._counts.evictions += need
                return victims
            if not chains.linked and not keep:  # no chain: the policy's choice
                victims += self._take(rest, kept, found)
            else:
                leaves = self._protection(found, spare, keep) if keep else kept
                victims += self._evict_leaves(rest, kept, found, leaves)
        self._counts.evictions += need
        return victims

    def _protection(
        self,
        found: set[bytes],
        spare: Callable[[bytes], bool] | None,
        keep: Collection[bytes] = (),
    ) -> Callable[[bytes], bool]:
        """The ``protected`` of an eviction: pinned, held and ``found`` chunks, those
        ``spare`` protects and ``keep``."""
        pins, held = self._pins, self._held
        if spare is not None:
            return lambda key: (
                key in pins or key in found or key in held or key in keep or spare(key)
            )
        # A set's own membership test, not a lambda: it is asked once per victim.
        kept: Callable[[bytes], bool] = nothing_protected
        if pins or found or keep:
            kept = (pins.keys() | found).union(keep).__contains__
        if held:  # passed over too, asked after the few pinned and found ones
            if kept is nothing_protected:
                return held.__contains__
            kept = functools.partial(_kept_or_held, kept, held)
        return kept

    def _evict_orphans(
        self, need: int, kept: Callable[[bytes], bool], found: set[bytes]
    ) -> list[bytes]:
        """Up to ``need`` unprotected ready orphans, oldest first; their own children
        become orphans as they go, and are taken too if still needed."""
        orphans, ready, policy = self._chains.orphans, self._ready, self.policy
        taken: list[bytes] = []
        while len(taken) < need and orphans:
            wanted = need - len(taken)
            batch = []
            for key in orphans:
                if key in ready and not kept(key):
                    batch.append(key)
                    if len(batch) == wanted:
                        break
            if not batch:
                break
            for key in batch:
                policy.remove(key)
            self._drop(batch)
            taken += batch
        self._counts.orphan_evictions += len(taken)
        return taken

    def _evict_leaves(
        self,
        need: int,
        kept: Callable[[bytes], bool],
        found: set[bytes],
        leaves: Callable[[bytes], bool],
    ) -> list[bytes]:
        """``need`` victims the policy picks among the leaves ``leaves`` does not protect
        (``kept`` and the store's parents) while there are any, then
        (``interior_evictions``) among those ``kept`` does not: pins, holds and a
        store's own chunks can protect every leaf, and room was promised
        (``_evictable``)."""
        chains = self._chains
        taken: list[bytes] = []
        while len(taken) < need:
            wanted = need - len(taken)
            batch = self.policy.evict(wanted, chains.leaf_guard(leaves))
            parents = chains.parents_of(batch) if len(batch) < wanted else []
            self._check_and_drop(batch, len(batch), found)
            taken += batch
            if len(batch) < wanted and not chains.new_leaves(parents):
                break  # every leaf left is protected: its ancestors must do
        if len(taken) < need:
            rest = self._take(need - len(taken), kept, found)
            self._counts.interior_evictions += len(rest)
            taken += rest
        return taken

    def _take(self, need: int, kept: Callable[[bytes], bool], found: set[bytes]) -> list[bytes]:
        """The policy's ``need`` victims among the chunks ``kept`` does not protect, freed."""
        victims = self.policy.evict(need, kept)
        self._check_and_drop(victims, need, found)
        return victims

    def _take_in_order(
        self, need: int, kept: Callable[[bytes], bool], found: set[bytes]
    ) -> list[bytes]:
        """:meth:`_evict_leaves` for a policy that takes a victim back: its own choice,
        checked as it leaves. One that turns out a parent (a pin, a hold or the store
        protected its child, or the policy ranked it before its child) is given back,
        ranked newest (where an order-keeping policy ranks a parent), and a leaf is
        taken instead. Such a policy ranks by recency: the store's parent, just used,
        is among the newest, and is not looked for."""
        policy, ready = self.policy, self._ready
        victims = policy.evict(need, kept)
        check_victims(
            policy.name, victims, need, ready=ready, pins=self._pins, found=found, held=self._held
        )
        slots = list(map(ready.__getitem__, victims))
        stay = self._chains.leave(victims, slots, give_back=True)
        if not stay:
            self._free_slots(victims, slots)
            return victims
        back = set(stay)
        policy.insert_many([victims[i] for i in stay])
        victims = [k for i, k in enumerate(victims) if i not in back]
        self._free_slots(victims, [s for i, s in enumerate(slots) if i not in back])
        return victims + self._evict_leaves(need - len(victims), kept, found, kept)

    def _check_and_drop(
        self,
        victims: list[bytes],
        need: int,
        found: set[bytes],
        slots: Sequence[int] | None = None,
    ) -> None:
        check_victims(
            self.policy.name,
            victims,
            need,
            ready=self._ready,
            pins=self._pins,
            found=found,
            held=self._held,
        )
        self._drop(victims, slots)

    def _drop(self, keys: Sequence[bytes], slots: Sequence[int] | None = None) -> None:
        """Free the slots of ready ``keys`` (the policy already let go of them), with events;
        ``slots``: theirs, if the caller has them."""
        if slots is None:
            slots = list(map(self._ready.__getitem__, keys))
        self._chains.leave(keys, slots)  # first: they are still ready
        self._free_slots(keys, slots)

    def _free_slots(self, keys: Sequence[bytes], slots: Sequence[int]) -> None:
        """:meth:`_drop` once the chains let go of ``keys``, in ``slots``."""
        free, ready = self._free, self._ready
        if self.record_events:
            record = self._events.append
            for key in keys:
                free.append(slot := ready.pop(key))
                record(IndexEvent(_REMOVED, key, slot))
        else:
            free += slots
            deque(map(ready.pop, keys), 0)
        if self.tenants is not None:
            self.tenants.dropped(keys, ready=True)
