"""Stateful property test of OffloadIndex against a plain reference model.

Hypothesis drives random interleavings of every index operation (correct
uses and protocol errors) over a small key universe and a small capacity,
for every registered policy and for admission-wrapped ones. After each step
the index must agree with the model: which keys are ready, in flight and
pinned, which slots they hold, what lookup returns and which events came out.
The model does not re-implement eviction order; it checks that whatever the
policy chose was allowed (unpinned, not protected by the call, ready).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvoffload.errors import ProtocolError
from kvoffload.manager import (
    AdmissionFilter,
    EventKind,
    EvictionPolicy,
    IndexEvent,
    LRUPolicy,
    OffloadIndex,
    S3FIFOPolicy,
)
from kvoffload.registry import POLICIES

CAPACITY = 5
UNIVERSE = [bytes([i]) * 16 for i in range(12)]
keys_st = st.sampled_from(UNIVERSE)
batch_st = st.lists(keys_st, min_size=0, max_size=7)
#: Each key's parent in its chain: two trees that branch (0-1-2-3, 1-4-5; 6-7-8-9, 7-10),
#: and 11 alone. Stores and ``link`` tell the index these; a lookup tells it its own guess
#: (the chunk before the first miss), which the model follows too.
PARENT = {
    UNIVERSE[c]: UNIVERSE[p]
    for c, p in {1: 0, 2: 1, 3: 2, 4: 1, 5: 4, 7: 6, 8: 7, 9: 8, 10: 7}.items()
}

PolicyFactory = Callable[[int], EvictionPolicy | str]


class IndexMachine(RuleBasedStateMachine):
    """One manager and its reference model; subclasses pick the policy."""

    make_policy: PolicyFactory = staticmethod(lambda capacity: "lru")
    #: Whether the index writes around for lower tiers (what admission turns away is stored).
    write_around = False

    def __init__(self) -> None:
        super().__init__()
        policy = self.make_policy(CAPACITY)
        self.manager = OffloadIndex(CAPACITY, policy, write_around=self.write_around)
        self.ready: dict[bytes, int] = {}
        self.storing: dict[bytes, int] = {}
        #: Keys in flight for the lower tiers only: their slots are freed on completion.
        self.around: set[bytes] = set()
        self.pins: Counter[bytes] = Counter()
        #: Chunks held for queued requests (holders each), and each hold's chunks.
        self.held: Counter[bytes] = Counter()
        self.holds: list[list[bytes]] = []
        self.hits = self.misses = self.evictions = self.stores = self.failures = 0
        self.rejected = self.written_around = self.spilled = 0
        #: Each present linked chunk's parent (present or not: an orphan), and where the
        #: last lookup stopped (its first miss, the chunk before it).
        self.links: dict[bytes, bytes] = {}
        self.after: tuple[bytes, bytes] | None = None

    # -- helpers -------------------------------------------------------------
    def free_slots(self) -> int:
        return CAPACITY - len(self.ready) - len(self.storing)

    def expect_events(self, expected: list[IndexEvent]) -> None:
        assert self.manager.take_events() == expected

    def expect_unchanged_after_error(self, call: Callable[[], object]) -> None:
        before = self.manager.stats()
        with pytest.raises(ProtocolError, match=r"chunk [0-9a-f]{16}"):
            call()
        assert self.manager.stats() == before
        self.expect_events([])

    # -- lookups and touches --------------------------------------------------
    @rule(keys=batch_st)
    def lookup(self, keys: list[bytes]) -> None:
        expected = 0
        for key in keys:
            if key not in self.ready:
                break
            expected += 1
        assert self.manager.lookup(keys) == expected
        self.hits += expected
        self.misses += len(keys) - expected
        if 0 < expected < len(keys):
            self.after = (keys[expected], keys[expected - 1])

    @rule(keys=batch_st)
    def touch(self, keys: list[bytes]) -> None:
        self.manager.touch(keys)

    @rule(keys=batch_st)
    def refresh(self, keys: list[bytes]) -> None:
        self.manager.refresh(keys)

    # -- loads -----------------------------------------------------------------
    @precondition(lambda self: self.ready)
    @rule(data=st.data())
    def prepare_load(self, data: st.DataObject) -> None:
        keys = data.draw(st.lists(st.sampled_from(sorted(self.ready)), min_size=1, max_size=3))
        result = self.manager.prepare_load(keys)
        assert result.keys == tuple(keys)
        assert result.slots == tuple(self.ready[key] for key in keys)
        self.pins.update(keys)

    @rule(key=keys_st)
    def prepare_load_not_ready(self, key: bytes) -> None:
        if key in self.ready:
            return
        self.expect_unchanged_after_error(lambda: self.manager.prepare_load([key]))

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def complete_load(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.pins)))
        self.manager.complete_load([key])
        self.pins[key] -= 1
        if not self.pins[key]:
            del self.pins[key]

    @rule(key=keys_st)
    def complete_load_unpinned(self, key: bytes) -> None:
        over = [key] * (self.pins[key] + 1)
        self.expect_unchanged_after_error(lambda: self.manager.complete_load(over))

    # -- holds of queued requests ---------------------------------------------------
    @rule(keys=batch_st, limit=st.integers(0, CAPACITY))
    def hold(self, keys: list[bytes], limit: int) -> None:
        expected = []
        for key in keys:
            if key not in self.ready:
                continue
            if not self.held[key] and len(+self.held) >= limit:
                break
            self.held[key] += 1
            expected.append(key)
        assert self.manager.hold(keys, limit) == expected
        self.holds.append(expected)

    @precondition(lambda self: self.holds)
    @rule(data=st.data())
    def unhold(self, data: st.DataObject) -> None:
        keys = self.holds.pop(data.draw(st.integers(0, len(self.holds) - 1)))
        self.manager.unhold(keys)
        for key in keys:
            if self.held[key]:
                self.held[key] -= 1
        self.held = +self.held

    # -- stores ----------------------------------------------------------------
    @rule(keys=batch_st, linked=st.booleans())
    def prepare_store(self, keys: list[bytes], linked: bool) -> None:
        self.checked_prepare_store(keys, linked)

    @rule(keys=batch_st, linked=st.booleans())
    def store_and_complete(self, keys: list[bytes], linked: bool) -> None:
        """The common flow, so that the index fills up with ready chunks often."""
        stored = self.checked_prepare_store(keys, linked)
        if stored:
            self.checked_complete_store(stored, success=True)

    def checked_prepare_store(self, keys: list[bytes], linked: bool = False) -> list[bytes]:
        unique = list(dict.fromkeys(keys))
        missing = [k for k in unique if k not in self.ready and k not in self.storing]
        found = {k for k in unique if k in self.ready}
        evictable = len(self.ready) - len(self.pins) - len(found - set(self.pins))
        evictable -= len(+self.held)  # never evicted; counted once more if pinned or found
        free_before = self.free_slots()
        before = self.manager.stats()
        parents = [PARENT.get(k) for k in keys] if linked else None
        result = self.manager.prepare_store(keys, parents=parents)
        short = len(missing) - free_before - evictable
        if short > len(+self.held):
            assert result is None
            assert self.manager.stats() == before
            self.expect_events([])
            return []
        if short > 0:  # the newest holds go, for the room the store needs
            for key in list(+self.held)[-short:]:
                del self.held[key]
            self.spilled += short
        assert result is not None
        stored = list(result.keys)
        assert [k for k in missing if k in set(stored)] == stored, "keys out of order or foreign"
        if type(self.manager.policy).admit is EvictionPolicy.admit or self.write_around:
            assert stored == missing, "every key is stored: admitted, or for the lower tiers"
        turned_away = self.manager.stats().rejected - before.rejected
        if self.write_around:
            marked = self.manager._cold - self.around  # which ones, the index's own record
            assert len(marked) == turned_away and marked <= set(stored)
            self.around |= marked
        else:
            assert turned_away == len(missing) - len(stored)
        self.rejected += turned_away
        assert len(result.slots) == len(stored)
        assert len(result.evicted) == max(0, len(stored) - free_before)
        for victim in result.evicted:
            assert victim in self.ready and victim not in self.pins and victim not in found
            assert victim not in self.held
        after = self.manager.stats()
        protected = set(self.pins) | found | set(+self.held)
        near = {PARENT.get(k) for k in keys} | ({self.after[1]} if self.after else set())
        self.check_eviction_order(
            list(result.evicted),
            after.orphan_evictions - before.orphan_evictions,
            after.interior_evictions - before.interior_evictions,
            protected,
            near,
        )
        events = [IndexEvent(EventKind.REMOVED, k, self.ready.pop(k)) for k in result.evicted]
        self.expect_events(events)
        self.leave(result.evicted)
        taken = set(self.ready.values()) | set(self.storing.values())
        assert not taken & set(result.slots)
        assert len(set(result.slots)) == len(stored)
        self.storing.update(zip(stored, result.slots, strict=True))
        self.evictions += len(result.evicted)
        if parents is not None:  # the index links the chunks it reserved
            self.link_model(stored, [PARENT.get(k) for k in stored])
        elif stored and self.after is not None and stored[0] == self.after[0]:
            self.link_model(stored[:1], [self.after[1]])  # the lookup's guess
        return stored

    # -- prefix order -----------------------------------------------------------------
    def children(self, key: bytes, among: set[bytes]) -> set[bytes]:
        return {c for c, p in self.links.items() if p == key and c in among}

    def check_eviction_order(
        self,
        evicted: list[bytes],
        orphans: int,
        interior: int,
        protected: set[bytes],
        near: set[bytes | None],
    ) -> None:
        """Orphans went first, then leaves (a victim's children left with it), and
        chunks with a child left only when no leaf could go (``near``: the store's
        chunks' parents, which it may spare)."""
        here = set(self.ready) | set(self.storing)
        for victim in evicted[:orphans]:
            assert victim in self.links and self.links[victim] not in here, "no orphan"
            here.discard(victim)
        if orphans < len(evicted):
            left = [k for k in here if k in self.ready and k not in protected]
            assert not [k for k in left if k in self.links and self.links[k] not in here], (
                "the policy was asked while an orphan could go"
            )
        leaves = evicted[orphans : len(evicted) - interior]
        for victim in leaves:
            assert self.children(victim, here) <= set(leaves), "a parent went before its child"
        here -= set(leaves)
        if interior:
            could = [
                k
                for k in here
                if k in self.ready and k not in protected and k not in near
                if not self.children(k, here)
            ]
            assert not could, "a chunk with a child went while a leaf could"

    def link_model(self, keys: list[bytes], parents: list[bytes | None]) -> None:
        """What ``OffloadIndex.link`` does: present keys not linked yet get their parent."""
        here = set(self.ready) | set(self.storing)
        for key, parent in zip(keys, parents, strict=True):
            if parent is not None and parent != key and key in here and key not in self.links:
                self.links[key] = parent

    def leave(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            self.links.pop(key, None)

    @rule(keys=batch_st)
    def link(self, keys: list[bytes]) -> None:
        parents = [PARENT.get(k) for k in keys]
        self.manager.link(keys, parents)
        self.link_model(keys, parents)

    @rule(keys=batch_st)
    def discard(self, keys: list[bytes]) -> None:
        dropped = self.manager.discard(keys)
        expected = list(dict.fromkeys(k for k in keys if k in self.ready and k not in self.pins))
        assert dropped == expected
        self.expect_events([IndexEvent(EventKind.REMOVED, k, self.ready.pop(k)) for k in dropped])
        for key in dropped:
            self.held.pop(key, None)
        self.leave(dropped)

    @precondition(lambda self: self.storing)
    @rule(data=st.data(), success=st.booleans())
    def complete_store(self, data: st.DataObject, success: bool) -> None:
        keys = data.draw(st.lists(st.sampled_from(sorted(self.storing)), min_size=1, unique=True))
        self.checked_complete_store(keys, success)

    def checked_complete_store(self, keys: list[bytes], success: bool) -> None:
        if success:
            self.manager.complete_store(keys)
        else:
            self.manager.abort_store(keys)
        slots = {key: self.storing.pop(key) for key in keys}
        around = [key for key in keys if key in self.around]
        self.around.difference_update(keys)
        if success:
            kept = [key for key in keys if key not in around]  # the others' slots are free
            self.ready.update((key, slots[key]) for key in kept)
            self.expect_events([IndexEvent(EventKind.STORED, k, slots[k]) for k in kept])
            self.stores += len(kept)
            self.written_around += len(around)
            self.leave(around)
        else:
            self.expect_events([])
            self.failures += len(keys)
            self.leave(keys)

    @rule(key=keys_st)
    def complete_store_not_in_flight(self, key: bytes) -> None:
        batch = [key, key] if key in self.storing else [key]
        self.expect_unchanged_after_error(lambda: self.manager.complete_store(batch))

    @rule()
    def reset(self) -> None:
        self.manager.reset()
        dropped = [k for k in self.ready if k not in self.pins]
        expected = {IndexEvent(EventKind.REMOVED, k, self.ready.pop(k)) for k in dropped}
        self.held.clear()  # every hold let go
        self.leave(dropped)
        events = self.manager.take_events()
        assert len(events) == len(expected) and set(events) == expected

    # -- invariants --------------------------------------------------------------
    @invariant()
    def agrees_with_model(self) -> None:
        manager = self.manager
        manager.check_integrity()
        stats = manager.stats()
        assert stats.ready == len(self.ready)
        assert stats.storing == len(self.storing)
        assert stats.pinned == len(self.pins)
        assert stats.used == len(self.ready) + len(self.storing) <= stats.capacity
        assert stats.free == self.free_slots()
        assert (stats.hits, stats.misses) == (self.hits, self.misses)
        assert stats.evictions == self.evictions
        assert stats.rejected == self.rejected
        assert (stats.stores, stats.store_failures) == (self.stores, self.failures)
        assert stats.written_around == self.written_around
        assert manager._cold == self.around
        assert stats.held == len(+self.held) and stats.spilled == self.spilled
        assert len(manager.policy) == len(self.ready)
        here = set(self.ready) | set(self.storing)
        orphans = {k for k, p in self.links.items() if p not in here}
        assert set(manager._chains.orphans) == orphans and stats.orphans == len(orphans)
        assert manager._chains.linked == len(self.links)
        slots = list(self.ready.values()) + list(self.storing.values())
        assert len(set(slots)) == len(slots)
        assert all(0 <= s < CAPACITY for s in slots)


FACTORIES: dict[str, PolicyFactory] = {name: (lambda c, n=name: n) for name in POLICIES.names()}
FACTORIES["admit+lru"] = lambda c: AdmissionFilter(LRUPolicy(c), window=3)
FACTORIES["admit+s3fifo"] = lambda c: AdmissionFilter(S3FIFOPolicy(c))

SETTINGS = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def _machine_test(name: str, write_around: bool = False) -> type:
    machine = type(f"IndexMachine_{name}", (IndexMachine,), {"write_around": write_around})
    machine.make_policy = staticmethod(FACTORIES[name])  # type: ignore[assignment]
    test_case = machine.TestCase
    test_case.settings = SETTINGS
    return test_case


for _name in FACTORIES:
    globals()[f"TestIndexMachine_{_name.replace('+', '_')}"] = _machine_test(_name)
# With lower tiers behind the index: what the filters turn away is stored for them.
for _name in ("adaptive", "admit+lru", "admit+s3fifo"):
    _test = f"TestIndexMachine_{_name.replace('+', '_')}_write_around"
    globals()[_test] = _machine_test(_name, write_around=True)
