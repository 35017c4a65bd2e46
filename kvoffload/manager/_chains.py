"""Prefix chains in the index: each chunk's parent, how many children it has, orphans.

A full-prefix chunk is worth loading only with every chunk before it, so the index keeps
prefix order whatever the policy (:mod:`kvoffload.manager._evictions`): a chunk with a
child present is not evicted while a leaf can go instead, and a chunk whose parent left
the CPU tier (an *orphan*) gives its room before the policy is asked. An orphan is not
freed at once: the engine's own prefix cache, or a lower tier, may still hold its
parent, and a hit that starts there reaches it.

The index learns a chunk's parent (the chunk before it in its group's chain) from the
caller that reserves it (``prepare_store(parents=...)`` or ``chain=True``), or from
``record_stores`` (:mod:`kvoffload.manager.usage`). A chunk is *present* while it is
ready or being stored, in one slot all along, so the links live in two lists indexed
by slot: by the child's slot, its parent's slot (``up``); by the parent's, how many
children it has (``kids``). The scheduler's common steps, a run of chunks stored and a
batch of leaves evicted, cost a few list operations at C speed and no hashing, and
memory is bounded by the capacity. A parent's children are looked for (a pass over the
chunks present) only where it leaves before them, which evictions avoid: a fallback,
a chunk dropped on request, a failed store, a reset, an orphan evicted. Window chunks
and states are no chains: they have no links.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import islice, repeat
from operator import eq
from typing import cast

from kvoffload.errors import IntegrityError
from kvoffload.keys import short_key
from kvoffload.manager.policy import nothing_protected

__all__ = ["NONE", "ORPHAN", "Chains", "is_run"]

#: ``up`` of a chunk with no link, and of an orphan (its parent's key: ``orphans``).
NONE, ORPHAN = -1, -2


def is_run(keys: Sequence[bytes], parents: Sequence[bytes | None]) -> bool:
    """Whether ``keys`` are consecutive chunks of one chain: each one's parent, after the
    first, is the key before it. Lists are compared at once (the same objects, mostly)."""
    if type(keys) is list and type(parents) is list:
        return parents[1:] == keys[:-1]
    return all(map(eq, islice(parents, 1, None), keys))


class Chains:
    """Parent links of the present chunks of one index, and which of them are orphans.

    ``ready`` and ``storing`` are the index's own dicts, key -> slot (read, never
    written here). By slot: ``up``, the parent's slot (``NONE``, ``ORPHAN``); ``kids``,
    how many present chunks link to it.
    """

    __slots__ = ("key_of", "kids", "linked", "orphans", "ready", "storing", "up", "waiting")

    def __init__(
        self, capacity: int, ready: Mapping[bytes, int], storing: Mapping[bytes, int]
    ) -> None:
        self.ready = ready
        self.storing = storing
        self.up: list[int] = [NONE] * capacity
        self.kids: list[int] = [0] * capacity
        #: By slot: the key reserved there last (the index writes it as it reserves).
        self.key_of: list[bytes | None] = [None] * capacity
        #: Present chunks whose parent is not present -> that parent, oldest orphan first.
        self.orphans: dict[bytes, bytes] = {}
        #: An absent parent -> its present children (the orphans, by parent).
        self.waiting: dict[bytes, list[bytes]] = {}
        #: How many present chunks are linked (orphans included).
        self.linked = 0

    def _slot(self, key: bytes) -> int | None:
        slot = self.ready.get(key)
        return self.storing.get(key) if slot is None else slot

    # -- links ---------------------------------------------------------------------
    def link(self, keys: Sequence[bytes], parents: Sequence[bytes | None]) -> None:
        """Each present key of ``keys`` has the parent at the same place in ``parents``
        (``None``: a chain's head, or no chain chunk). Keys not present are skipped, and
        so are keys linked already (a chunk's parent never changes: its key names its
        prefix)."""
        up = self.up
        slots = list(map(self._slot, keys))
        if len(keys) > 1 and None not in slots and len(set(keys)) == len(keys):
            present = cast("list[int]", slots)  # None is not in it
            start = 0 if up[present[0]] == NONE else 1  # the head's linked at its reservation
            if all(at == NONE for at in map(up.__getitem__, islice(present, start, None))):
                self.link_new(keys[start:], present[start:], parents[start:])
                return
        for key, slot, parent in zip(keys, slots, parents, strict=True):
            if slot is not None and parent is not None and parent != key and up[slot] == NONE:
                self._add(key, slot, parent)

    def link_new(
        self,
        keys: Sequence[bytes],
        slots: Sequence[int],
        parents: Sequence[bytes | None],
        run: bool | None = None,
        fresh: bool = False,
    ) -> None:
        """:meth:`link` for present chunks, each once, with no link of their own yet
        (chunks just reserved: links go when a chunk leaves), in ``slots``. A run of one
        chain (``run``, if the caller knows: :func:`is_run`) is linked at C speed;
        ``fresh``: none of them has a child yet."""
        n = len(keys)
        if run is None:
            run = n > 1 and is_run(keys, parents)
        if run and n > 1:
            self.link_run(keys, slots, parents[0], fresh)
            return
        add = self._add
        for key, slot, parent in zip(keys, slots, parents, strict=True):
            if parent is not None and parent != key:
                add(key, slot, parent)

    def link_run(
        self, keys: Sequence[bytes], slots: Sequence[int], head: bytes | None, fresh: bool
    ) -> None:
        """:meth:`link_new` for consecutive chunks of one chain after ``head`` (``None``:
        from its head). ``fresh``: none has a child yet (no orphan waited for them)."""
        kids, n = self.kids, len(keys)
        parent_slots = slots[:-1]
        deque(map(self.up.__setitem__, islice(slots, 1, None), parent_slots), 0)
        if fresh:
            deque(map(kids.__setitem__, parent_slots, repeat(1)), 0)
        else:  # some have children that waited for them (``arrive``)
            for at in parent_slots:
                kids[at] += 1
        self.linked += n - 1
        if head is not None and head != keys[0]:
            self._add(keys[0], slots[0], head)

    def _add(self, key: bytes, slot: int, parent: bytes) -> None:
        """Link the present, unlinked ``key`` in ``slot`` to ``parent``."""
        self.linked += 1
        above = self.ready.get(parent)
        if above is None:
            above = self.storing.get(parent)
        if above is None:
            self.up[slot] = ORPHAN
            self.orphans[key] = parent
            self.waiting.setdefault(parent, []).append(key)
        else:
            self.up[slot] = above
            self.kids[above] += 1

    # -- chunks arriving and leaving ---------------------------------------------------
    def arrive(self, keys: Iterable[bytes], slots: Iterable[int]) -> None:
        """``keys`` are present again, in ``slots``: their waiting children are no orphans.

        Only an absent chunk has orphan children, so the caller asks only while some
        wait."""
        waiting, orphans, up, kids = self.waiting, self.orphans, self.up, self.kids
        for key, slot in zip(keys, slots, strict=True):
            children = waiting.pop(key, None)
            for child in children or ():
                del orphans[child]
                child_slot = self._slot(child)
                assert child_slot is not None  # an orphan is present
                up[child_slot] = slot
                kids[slot] += 1

    def leave(
        self, keys: Sequence[bytes], slots: Sequence[int], give_back: bool = False
    ) -> list[int]:
        """``keys``, in ``slots`` (still ready or being stored), leave: their links go.

        One that keeps a child present: with ``give_back``, it stays as it was, and its
        place in ``keys`` is returned (the caller keeps it); without, its children are
        orphans now. The common batch (leaves, or a chain's tail) costs a few list
        operations at C speed and a subtraction per linked key."""
        if not self.linked:
            return []
        up, kids = self.up, self.kids
        above = list(map(up.__getitem__, slots))
        for at in above:
            if at >= 0:
                kids[at] -= 1
        stay: list[int] = []
        if any(map(kids.__getitem__, slots)):  # a child stays
            if give_back:
                stay = self._stay(slots, above)
                gone = set(stay)
                keys = [k for i, k in enumerate(keys) if i not in gone]
                slots = [s for i, s in enumerate(slots) if i not in gone]
                above = [a for i, a in enumerate(above) if i not in gone]
            else:
                self._orphan_children(keys, slots)
        linked = len(above) - above.count(NONE)
        if linked:
            if ORPHAN in above:
                for key, at in zip(keys, above, strict=True):
                    if at == ORPHAN:
                        self._forget_orphan(key)
            deque(map(up.__setitem__, slots, repeat(NONE)), 0)
            self.linked -= linked
        return stay

    def _stay(self, slots: Sequence[int], above: Sequence[int]) -> list[int]:
        """The places in ``slots`` of those that keep a child, as the others leave (their
        parents' slots: ``above``): a parent that stays keeps its own parent here too."""
        kids, stay = self.kids, set[int]()
        grew = True
        while grew:
            grew = False
            for i, slot in enumerate(slots):
                if i not in stay and kids[slot]:
                    stay.add(i)
                    grew = True
                    if above[i] >= 0:
                        kids[above[i]] += 1  # it is its parent's child still
        return sorted(stay)

    def _forget_orphan(self, key: bytes) -> None:
        parent = self.orphans.pop(key)
        siblings = self.waiting[parent]
        siblings.remove(key)
        if not siblings:
            del self.waiting[parent]

    def _orphan_children(self, keys: Sequence[bytes], slots: Sequence[int]) -> None:
        """The children that stay of ``keys`` (leaving, in ``slots``) are orphans now:
        found by a search of ``up`` at C speed (a parent rarely leaves first)."""
        up, kids, key_of, leaving = self.up, self.kids, self.key_of, set(keys)
        for parent, slot in zip(keys, slots, strict=True):
            if not kids[slot]:
                continue
            kids[slot] = 0
            at = up.index(slot)  # its first child: it has one
            while True:
                child = key_of[at]
                assert child is not None  # a slot linked to is taken
                if child not in leaving:
                    up[at] = ORPHAN
                    self.orphans[child] = parent
                    self.waiting.setdefault(parent, []).append(child)
                try:
                    at = up.index(slot, at + 1)
                except ValueError:
                    break

    # -- what evictions ask ----------------------------------------------------------
    def parents_of(self, keys: Iterable[bytes]) -> list[int]:
        """The parents' slots of ready ``keys`` (``NONE``, ``ORPHAN``: none there)."""
        up, ready = self.up, self.ready
        return [up[ready[key]] for key in keys]

    def leaf_guard(self, kept: Callable[[bytes], bool]) -> Callable[[bytes], bool]:
        """The ``protected`` of one ``evict`` call that takes leaves only: what ``kept``
        protects, and every chunk with a child present that this call does not take.

        A policy asks ``protected`` of a key only to take it on ``False``
        (:mod:`kvoffload.manager.policy`), so the guard counts what the call takes: a
        chain whose tail goes may lose its parent in the same call, as the policy
        ranked it, instead of another chain's leaf.
        """
        slot_of, up, kids = self.ready.__getitem__, self.up, self.kids  # of ready keys
        taken: dict[int, int] = {}  # children this call takes, by their parent's slot
        count = taken.get

        def protected(key: bytes) -> bool:
            slot = slot_of(key)
            n = kids[slot]
            if (n and n > count(slot, 0)) or kept(key):
                return True
            at = up[slot]
            taken[at] = count(at, 0) + 1
            return False

        def protected_leaf(key: bytes) -> bool:  # nothing else protected: kept is not asked
            slot = slot_of(key)
            n = kids[slot]
            if n and n > count(slot, 0):
                return True
            at = up[slot]
            taken[at] = count(at, 0) + 1
            return False

        return protected_leaf if kept is nothing_protected else protected

    def new_leaves(self, parents: Iterable[int]) -> bool:
        """Whether the chunk in one of ``parents`` (slots of evicted chunks' parents) has
        no child left: a leaf now, or a chunk being stored."""
        kids = self.kids
        return any(at >= 0 and not kids[at] for at in parents)

    # -- integrity -----------------------------------------------------------------
    def check(self) -> None:
        """Raise ``IntegrityError`` with the numbers if the links disagree with the index."""
        present = {**self.ready, **self.storing}
        key_at = {slot: key for key, slot in present.items()}
        up, kids = self.up, self.kids
        stray = sum(1 for s in range(len(up)) if s not in key_at and (up[s] != NONE or kids[s]))
        wrong = sum(1 for s in key_at if up[s] >= 0 and up[s] not in key_at)
        counts = Counter(up[s] for s in key_at if up[s] >= 0)
        miscounted = sum(1 for s in key_at if kids[s] != counts.get(s, 0))
        linked = sum(1 for s in key_at if up[s] != NONE)
        if stray or wrong or miscounted or linked != self.linked:
            raise IntegrityError(
                f"chains: {stray} free slot(s) keep links, {wrong} link(s) to a slot not "
                f"present, {miscounted} child count(s) wrong, {linked} linked chunk(s) "
                f"counted as {self.linked}"
            )
        orphans = {key_at[s] for s in key_at if up[s] == ORPHAN}
        waiting = sorted(c for children in self.waiting.values() for c in children)
        back = [k for k, parent in self.orphans.items() if parent in present]
        if orphans != self.orphans.keys() or waiting != sorted(orphans) or back:
            odd = orphans ^ self.orphans.keys()
            raise IntegrityError(
                f"chains: {len(self.orphans)} orphan(s) recorded, {len(orphans)} linked to no "
                f"slot, {len(waiting)} waiting, {len(back)} whose parent is present"
                + (f" (e.g. {short_key(next(iter(odd)))})" if odd else "")
            )
