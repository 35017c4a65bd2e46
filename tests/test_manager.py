"""Scenario tests of OffloadIndex, each run against every registered policy."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvoffload import CacheGroup, KVLayout, build_offloading_config
from kvoffload.errors import ConfigError, IntegrityError, ProtocolError
from kvoffload.manager import (
    AdmissionFilter,
    EventKind,
    IndexEvent,
    LoadResult,
    LRUPolicy,
    OffloadIndex,
    StoreResult,
)
from kvoffload.registry import DEFAULT_POLICY, POLICIES

POLICY_NAMES = POLICIES.names()


def key(i: int) -> bytes:
    return i.to_bytes(2, "big") * 8


K = [key(i) for i in range(32)]


def filled(policy: str, capacity: int, count: int) -> OffloadIndex:
    """A manager holding ``K[:count]`` ready, stored in order."""
    manager = OffloadIndex(capacity, policy)
    result = manager.prepare_store(K[:count])
    assert result is not None
    manager.complete_store(result.keys)
    manager.take_events()
    return manager


def snapshot(manager: OffloadIndex) -> tuple[object, ...]:
    """Everything observable without side effects beyond hit counters."""
    return (manager.stats(), list(manager._ready.items()), list(manager._storing.items()))


@pytest.fixture(params=POLICY_NAMES)
def policy(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


def test_empty_index_misses(policy: str) -> None:
    manager = OffloadIndex(4, policy)
    assert manager.lookup(K[:3]) == 0
    assert manager.lookup([]) == 0
    stats = manager.stats()
    assert (stats.hits, stats.misses, stats.lookups) == (0, 3, 2)
    assert manager.take_events() == []


def test_store_is_not_ready_until_completed(policy: str) -> None:
    manager = OffloadIndex(8, policy)
    store = manager.prepare_store(K[:3])
    assert store is not None
    assert store.keys == tuple(K[:3]) and store.evicted == ()
    assert manager.lookup(K[:3]) == 0
    before = snapshot(manager)
    with pytest.raises(ProtocolError, match="still being stored"):
        manager.prepare_load(K[:1])
    assert snapshot(manager) == before
    manager.complete_store(store.keys[:2])
    assert manager.lookup(K[:3]) == 2, "lookup stops at the key still in flight"
    assert manager.prepare_load(K[:2]).slots == store.slots[:2]
    assert manager.take_events() == [
        IndexEvent(EventKind.STORED, K[0], store.slots[0]),
        IndexEvent(EventKind.STORED, K[1], store.slots[1]),
    ]
    assert manager.take_events() == []


def test_failed_store_frees_slots_and_emits_nothing(policy: str) -> None:
    manager = OffloadIndex(2, policy)
    store = manager.prepare_store(K[:2])
    assert store is not None
    manager.abort_store(store.keys)
    assert manager.take_events() == []
    assert manager.lookup(K[:2]) == 0
    stats = manager.stats()
    assert (stats.used, stats.store_failures, stats.stores) == (0, 2, 0)
    again = manager.prepare_store(K[:2])
    assert again is not None and sorted(again.slots) == [0, 1]
    manager.check_integrity()


def test_prepare_store_skips_stored_in_flight_and_duplicates(policy: str) -> None:
    manager = filled(policy, 8, 2)
    first = manager.prepare_store([K[2], K[2], K[3]])
    assert first is not None and first.keys == (K[2], K[3])
    second = manager.prepare_store([K[0], K[2], K[4], K[4], K[1]])
    assert second is not None
    assert second.keys == (K[4],) and len(second.slots) == 1
    assert len(set(first.slots + second.slots)) == 3
    assert manager.stats().storing == 3
    manager.check_integrity()


def test_batch_never_evicts_its_own_stored_keys(policy: str) -> None:
    manager = filled(policy, 4, 4)
    # K0 and K1 are the oldest: every policy would evict them first, but this
    # call found them stored, so the room must come from K2 and K3.
    store = manager.prepare_store([K[0], K[1], K[10], K[11]])
    assert store is not None
    assert store.keys == (K[10], K[11])
    assert sorted(store.evicted) == sorted([K[2], K[3]])
    assert manager.lookup(K[:2]) == 2
    events = manager.take_events()
    assert [e.kind for e in events] == [EventKind.REMOVED] * 2
    assert sorted(e.slot for e in events) == sorted(store.slots)
    manager.check_integrity()


def test_batch_larger_than_capacity_is_refused(policy: str) -> None:
    manager = OffloadIndex(3, policy)
    assert manager.prepare_store(K[:4]) is None
    assert manager.stats().used == 0


def test_pins_stack_and_protect_from_eviction(policy: str) -> None:
    manager = filled(policy, 2, 2)
    slot0 = manager.prepare_load([K[0]]).slots[0]
    manager.prepare_load([K[0], K[1]])
    manager.complete_load([K[1]])
    manager.complete_load([K[0]])
    assert manager.stats().pinned == 1, "K0 still holds its second pin"
    store = manager.prepare_store([K[5]])
    assert store is not None and store.evicted == (K[1],)
    assert manager.prepare_store([K[6]]) is None, "only K0 (pinned) and K5 (in flight) are left"
    manager.complete_load([K[0]])
    store = manager.prepare_store([K[6]])
    assert store is not None and store.evicted == (K[0],) and store.slots == (slot0,)


def test_refused_store_changes_nothing_not_even_policy_order(policy: str) -> None:
    def scenario(with_refusal: bool) -> list[bytes]:
        manager = filled(policy, 4, 4)
        manager.touch([K[2], K[0], K[2]])
        manager.prepare_load(K[:4])
        if with_refusal:
            before = snapshot(manager)
            assert manager.prepare_store([K[1], K[20], K[21]]) is None
            assert snapshot(manager) == before
            assert manager.take_events() == []
        manager.complete_load(K[:4])
        evicted: list[bytes] = []
        for i in range(24, 28):
            store = manager.prepare_store([K[i]])
            assert store is not None
            evicted += store.evicted
            manager.complete_store(store.keys)
        return evicted

    assert scenario(with_refusal=True) == scenario(with_refusal=False)


def test_evicted_slot_is_reused_and_reported_before_the_store(policy: str) -> None:
    manager = filled(policy, 1, 1)
    store = manager.prepare_store([K[1]])
    assert store == StoreResult((K[1],), (0,), (K[0],))
    manager.complete_store(store.keys)
    assert manager.take_events() == [
        IndexEvent(EventKind.REMOVED, K[0], 0),
        IndexEvent(EventKind.STORED, K[1], 0),
    ]
    assert manager.stats().evictions == 1


def test_prepare_load_returns_slots_and_pins_each_occurrence(policy: str) -> None:
    manager = filled(policy, 4, 3)
    load = manager.prepare_load([K[2], K[0], K[2]])
    assert isinstance(load, LoadResult)
    assert load.keys == (K[2], K[0], K[2])
    assert load.slots[0] == load.slots[2] != load.slots[1]
    manager.complete_load([K[2], K[2], K[0]])
    assert manager.stats().pinned == 0


@pytest.mark.parametrize(
    ("prepare", "call", "message"),
    [
        (None, lambda m: m.prepare_load([K[0], K[9]]), "not stored"),
        (None, lambda m: m.complete_load([K[0]]), "0 pin"),
        (lambda m: m.prepare_load([K[0]]), lambda m: m.complete_load([K[0], K[0]]), "1 pin"),
        (None, lambda m: m.complete_store([K[9]]), "no store in flight"),
        (None, lambda m: m.complete_store([K[0]]), "no store in flight"),
        (lambda m: m.prepare_store([K[9]]), lambda m: m.complete_store([K[9], K[9]]), "twice"),
        (
            lambda m: m.prepare_store([K[8], K[9]]),
            lambda m: m.abort_store([K[8], K[10]]),
            "no store in flight",
        ),
    ],
)
def test_protocol_errors_name_the_key_and_change_nothing(
    policy: str,
    prepare: Callable[[OffloadIndex], object] | None,
    call: Callable[[OffloadIndex], object],
    message: str,
) -> None:
    manager = filled(policy, 6, 3)
    if prepare is not None:
        prepare(manager)
    before = snapshot(manager)
    with pytest.raises(ProtocolError, match=rf"chunk [0-9a-f]{{16}}\.\.\. .*{message}"):
        call(manager)
    assert snapshot(manager) == before
    assert manager.take_events() == []
    manager.check_integrity()


def test_complete_store_twice_across_calls(policy: str) -> None:
    manager = OffloadIndex(2, policy)
    store = manager.prepare_store([K[0]])
    assert store is not None
    manager.complete_store(store.keys)
    with pytest.raises(ProtocolError, match=K[0].hex()[:16]):
        manager.complete_store(store.keys)


def test_touch_ignores_unknown_and_in_flight_keys(policy: str) -> None:
    manager = filled(policy, 4, 2)
    manager.prepare_store([K[3]])
    manager.touch([K[9], K[3], K[0]])
    assert len(manager.policy) == 2
    manager.check_integrity()


def test_reset_keeps_pinned_and_in_flight_chunks(policy: str) -> None:
    manager = filled(policy, 4, 3)
    manager.prepare_load([K[1]])
    store = manager.prepare_store([K[5]])
    assert store is not None
    manager.reset()
    events = manager.take_events()
    assert sorted(e.key for e in events) == [K[0], K[2]]
    assert {e.kind for e in events} == {EventKind.REMOVED}
    assert manager.lookup([K[1]]) == 1 and manager.lookup([K[0]]) == 0
    manager.complete_store(store.keys)
    manager.complete_load([K[1]])
    assert manager.lookup([K[1], K[5]]) == 2
    stats = manager.stats()
    assert (stats.ready, stats.removed, stats.resets) == (2, 2, 1)
    manager.check_integrity()


def test_discard_drops_only_ready_unpinned_chunks(policy: str) -> None:
    manager = filled(policy, 4, 3)
    manager.prepare_load([K[1]])
    store = manager.prepare_store([K[5]])
    assert store is not None
    dropped = manager.discard([K[0], K[1], K[5], K[9], K[0]])  # pinned, in flight, unknown
    assert dropped == [K[0]]
    assert [(e.kind, e.key) for e in manager.take_events()] == [(EventKind.REMOVED, K[0])]
    assert manager.ready_mask([K[0], K[1], K[2]]) == [False, True, True]
    manager.check_integrity()  # the policy forgot it too
    again = manager.prepare_store([K[6]])  # its slot is free again
    assert again is not None and again.evicted == ()
    manager.complete_store([*store.keys, *again.keys])
    manager.complete_load([K[1]])
    assert manager.stats().removed == 1
    manager.check_integrity()


def test_discard_gives_a_tenant_its_share_back() -> None:
    manager = OffloadIndex(4, "lru", tenant_share=0.5)
    for tenant, keys in (("a", K[:2]), ("b", K[2:4])):
        stored = manager.prepare_store(keys, tenant=tenant)
        assert stored is not None
        manager.complete_store(stored.keys)
    assert manager.discard([K[0]]) == [K[0]]
    manager.check_integrity()  # the tenants' counts agree with the index
    again = manager.prepare_store([K[5]], tenant="a")
    assert again is not None and again.evicted == ()  # a's freed slot, nobody evicted
    manager.complete_store(again.keys)
    manager.check_integrity()


def test_record_events_off(policy: str) -> None:
    manager = OffloadIndex(1, policy, record_events=False)
    for i in range(3):
        store = manager.prepare_store([K[i]])
        assert store is not None
        manager.complete_store(store.keys)
    manager.reset()
    assert manager.take_events() == []
    assert manager.stats().evictions == 2


def test_stats_shape(policy: str) -> None:
    manager = filled(policy, 5, 2)
    stats = manager.stats()
    assert stats.capacity == 5 and stats.used == 2 and stats.free == 3
    assert stats.stores == 2 and stats.pinned == 0
    assert manager.policy.name == policy


def test_constructor_validation() -> None:
    for bad in (0, -1, 2.0, True, "4"):
        with pytest.raises(ConfigError, match="num_chunks"):
            OffloadIndex(bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="unknown eviction policy 'nope'"):
        OffloadIndex(4, "nope")
    with pytest.raises(ConfigError, match="capacity 3"):
        OffloadIndex(4, LRUPolicy(3))
    assert OffloadIndex(4).policy.name == DEFAULT_POLICY
    instance = LRUPolicy(4)
    assert OffloadIndex(4, instance).policy is instance


def test_admission_filter_stores_on_second_offer() -> None:
    manager = OffloadIndex(4, AdmissionFilter(LRUPolicy(4)))
    first = manager.prepare_store(K[:2])
    assert first == StoreResult((), (), ())
    assert manager.stats().rejected == 2
    second = manager.prepare_store(K[:3])
    assert second is not None and second.keys == (K[0], K[1])
    assert manager.policy.name == "admit+lru"


def test_refused_store_records_no_sighting() -> None:
    manager = OffloadIndex(2, AdmissionFilter(LRUPolicy(2)))
    for _ in range(2):
        store = manager.prepare_store(K[:2])
        assert store is not None
    manager.complete_store(K[:2])
    manager.prepare_load(K[:2])
    assert manager.prepare_store([K[7]]) is None
    manager.complete_load(K[:2])
    store = manager.prepare_store([K[7]])
    assert store is not None and store.keys == (), "the refused offer must not count"


def test_check_integrity_reports_numbers() -> None:
    manager = filled("lru", 4, 2)
    manager.check_integrity()
    manager._free.append(0)
    with pytest.raises(IntegrityError, match=r"2 ready \+ 0 storing \+ 3 free = 5, capacity is 4"):
        manager.check_integrity()
    manager = filled("lru", 4, 2)
    manager.policy.remove(K[0])
    with pytest.raises(IntegrityError, match="tracks 1 keys, the index has 2"):
        manager.check_integrity()


class _WrongVictims(LRUPolicy):
    """A broken policy that evicts the newest key even when it is protected."""

    def evict(self, n: int, protected: Callable[[bytes], bool]) -> list[bytes]:
        return list(self._order)[-n:]


def test_out_of_sync_policy_is_caught() -> None:
    manager = OffloadIndex(2, _WrongVictims(2))
    store = manager.prepare_store(K[:2])
    assert store is not None
    manager.complete_store(store.keys)
    manager.prepare_load([K[1]])
    with pytest.raises(IntegrityError, match="out of sync"):
        manager.prepare_store([K[5]])
    assert manager.lookup(K[:2]) == 2


def test_from_config_uses_the_policy_and_store_threshold() -> None:
    layout = KVLayout(groups=(CacheGroup("full", 16, ("l0",), 1024),))
    plain = OffloadIndex.from_config(
        build_offloading_config({"cpu_bytes_to_use": 8 * 1024, "eviction_policy": "arc"}, layout)
    )
    assert (plain.capacity, plain.policy.name) == (8, "arc")
    strict = OffloadIndex.from_config(
        build_offloading_config({"cpu_bytes_to_use": 8 * 1024, "store_threshold": 3}, layout)
    )
    key = [bytes([1]) * 16]
    offers = []
    for _ in range(3):
        store = strict.prepare_store(key)
        assert store is not None
        offers.append(store.keys)
    assert offers == [(), (), tuple(key)]  # stored on the third sighting


# -- write-around: what admission turns away still reaches the lower tiers ----------------
def test_a_turned_away_store_is_made_for_the_lower_tiers_and_leaves_no_chunk_here() -> None:
    index = OffloadIndex(4, AdmissionFilter(LRUPolicy(4)), write_around=True)
    first = index.prepare_store(K[:2])  # first sightings: turned away from this tier
    assert first is not None and first.keys == (K[0], K[1]) and len(first.slots) == 2
    assert index.stats().storing == 2 and index.stats().rejected == 2
    index.check_integrity()
    index.complete_store([K[1], K[0]])
    stats = index.stats()
    assert (stats.ready, stats.free, stats.stores, stats.written_around) == (0, 4, 0, 2)
    assert index.take_events() == [] and index.lookup(K[:1]) == 0
    # A second sighting is admitted (and stays); a first one beside it is written around.
    both = index.prepare_store([K[0], K[2]])
    assert both is not None and both.keys == (K[0], K[2])
    index.complete_store([K[2], K[0]])
    assert index.lookup([K[0]]) == 1 and index.lookup([K[2]]) == 0
    assert index.stats().written_around == 3 and len(index.policy) == 1
    index.check_integrity()


def test_a_failed_store_for_the_lower_tiers_frees_its_slot_like_any_other() -> None:
    index = OffloadIndex(2, AdmissionFilter(LRUPolicy(2)), write_around=True)
    store = index.prepare_store([K[0]])
    assert store is not None and store.keys == (K[0],)
    index.abort_store([K[0]])
    assert index.stats().store_failures == 1 and index.stats().free == 2
    index.check_integrity()
    again = index.prepare_store([K[0]])  # the filter saw it once: admitted now
    assert again is not None and again.keys == (K[0],)
    index.complete_store([K[0]])
    assert index.lookup([K[0]]) == 1 and index.stats().written_around == 0


def test_without_lower_tiers_a_turned_away_store_is_not_made() -> None:
    index = OffloadIndex(4, AdmissionFilter(LRUPolicy(4)))
    store = index.prepare_store(K[:2])
    assert store is not None and store.keys == () and index.stats().storing == 0


@pytest.mark.parametrize(
    ("tiers", "around"),
    [({}, False), ({"disk_path": "/tmp/kvoffload-x", "disk_bytes_to_use": 1 << 20}, True),
     ({"remote_url": "redis://127.0.0.1:1"}, True)],
)  # fmt: skip
def test_the_index_writes_around_when_a_lower_tier_is_configured(
    tiers: dict[str, object], around: bool
) -> None:
    layout = KVLayout(groups=(CacheGroup("full", 16, ("l0",), 1024),))
    config = build_offloading_config({"cpu_bytes_to_use": 8 * 1024, **tiers}, layout)
    assert OffloadIndex.from_config(config).write_around is around
