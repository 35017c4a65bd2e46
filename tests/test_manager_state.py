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
from collections.abc import Callable

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
    @rule(keys=batch_st)
    def prepare_store(self, keys: list[bytes]) -> None:
        self.checked_prepare_store(keys)

    @rule(keys=batch_st)
    def store_and_complete(self, keys: list[bytes]) -> None:
        """The common flow, so that the index fills up with ready chunks often."""
        stored = self.checked_prepare_store(keys)
        if stored:
            self.checked_complete_store(stored, success=True)

    def checked_prepare_store(self, keys: list[bytes]) -> list[bytes]:
        unique = list(dict.fromkeys(keys))
        missing = [k for k in unique if k not in self.ready and k not in self.storing]
        found = {k for k in unique if k in self.ready}
        evictable = len(self.ready) - len(self.pins) - len(found - set(self.pins))
        evictable -= len(+self.held)  # never evicted; counted once more if pinned or found
        free_before = self.free_slots()
        before = self.manager.stats()
        result = self.manager.prepare_store(keys)
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
        events = [IndexEvent(EventKind.REMOVED, k, self.ready.pop(k)) for k in result.evicted]
        self.expect_events(events)
        taken = set(self.ready.values()) | set(self.storing.values())
        assert not taken & set(result.slots)
        assert len(set(result.slots)) == len(stored)
        self.storing.update(zip(stored, result.slots, strict=True))
        self.evictions += len(result.evicted)
        return stored

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
        else:
            self.expect_events([])
            self.failures += len(keys)

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
