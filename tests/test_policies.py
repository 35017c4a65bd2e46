"""Eviction policies: the shared protocol, then what makes each one itself."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.errors import ConfigError, IntegrityError
from kvoffload.manager import (
    AdmissionFilter,
    ARCPolicy,
    EvictionPolicy,
    LRUPolicy,
    OffloadIndex,
    S3FIFOPolicy,
)
from kvoffload.manager.policies._segmented import SegmentedLRU
from kvoffload.registry import POLICIES

K = [i.to_bytes(2, "big") * 8 for i in range(64)]

FACTORIES: dict[str, Callable[[int], EvictionPolicy]] = {
    name: (lambda c, n=name: POLICIES.create(n, c)) for name in POLICIES.names()
}
FACTORIES["admit+lru"] = lambda c: AdmissionFilter(LRUPolicy(c))
FACTORIES["admit+arc"] = lambda c: AdmissionFilter(ARCPolicy(c), window=2)
FACTORIES["slru"] = lambda c: SegmentedLRU(c, c // 2)  # the adaptive policy's residents


def never(key: bytes) -> bool:
    return False


@pytest.fixture(params=sorted(FACTORIES))
def make(request: pytest.FixtureRequest) -> Callable[[int], EvictionPolicy]:
    return FACTORIES[request.param]


# -- the protocol, for every policy ---------------------------------------------
def test_registered_names_match_classes() -> None:
    for name in POLICIES.names():
        policy = POLICIES.create(name, 4)
        assert isinstance(policy, EvictionPolicy) and policy.name == name
        assert policy.capacity == 4


@pytest.mark.parametrize("cls", [LRUPolicy, ARCPolicy, S3FIFOPolicy])
@pytest.mark.parametrize("capacity", [0, -3, 1.5, True, None])
def test_capacity_validation(cls: type[EvictionPolicy], capacity: object) -> None:
    with pytest.raises(ConfigError, match="capacity must be a positive int"):
        cls(capacity)  # type: ignore[arg-type]


def test_unknown_keys_are_ignored(make: Callable[[int], EvictionPolicy]) -> None:
    policy = make(4)
    policy.touch(K[0])
    policy.remove(K[0])
    policy.on_miss(K[0])
    assert len(policy) == 0 and policy.evict(2, never) == []
    policy.check_integrity(set())


def test_evict_skips_protected_and_stops_short(make: Callable[[int], EvictionPolicy]) -> None:
    policy = make(4)
    for key in K[:4]:
        policy.insert(key)
    pinned = {K[0], K[2]}
    victims = policy.evict(3, lambda key: key in pinned)
    assert sorted(victims) == [K[1], K[3]]
    assert len(policy) == 2
    policy.check_integrity(pinned)
    assert policy.evict(1, lambda key: True) == []


def test_reset_forgets_everything(make: Callable[[int], EvictionPolicy]) -> None:
    policy = make(3)
    for key in K[:3]:
        policy.insert(key)
    policy.evict(2, never)
    policy.reset()
    assert len(policy) == 0
    policy.check_integrity(set())


def test_check_integrity_detects_a_foreign_set(make: Callable[[int], EvictionPolicy]) -> None:
    policy = make(3)
    policy.insert(K[0])
    with pytest.raises(IntegrityError, match="tracks 1 keys"):
        policy.check_integrity({K[0], K[1]})
    if isinstance(policy, LRUPolicy | ARCPolicy | S3FIFOPolicy | SegmentedLRU):
        with pytest.raises(IntegrityError, match="does not hold"):
            policy.check_integrity({K[1]})


ops_st = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.integers(0, 11)),
        st.tuples(st.just("touch"), st.integers(0, 11)),
        st.tuples(st.just("refresh"), st.integers(0, 11)),
        st.tuples(st.just("remove"), st.integers(0, 11)),
        st.tuples(st.just("evict"), st.integers(0, 4), st.frozensets(st.integers(0, 11))),
    ),
    max_size=60,
)


@pytest.mark.parametrize("name", sorted(FACTORIES))
@settings(max_examples=80, deadline=None)
@given(ops=ops_st)
def test_protocol_against_a_resident_set(name: str, ops: list[tuple[object, ...]]) -> None:
    """Victims are resident, unprotected, distinct and exactly as many as possible."""
    capacity = 6
    policy = FACTORIES[name](capacity)
    resident: set[bytes] = set()
    for op in ops:
        kind, index = op[0], op[1]
        assert isinstance(index, int)
        key = K[index]
        if kind == "insert" and key not in resident and len(resident) < capacity:
            policy.insert(key)
            resident.add(key)
        elif kind == "touch":
            policy.touch(key)
        elif kind == "refresh":
            policy.refresh(key)
        elif kind == "remove":
            policy.remove(key)
            resident.discard(key)
        elif kind == "evict":
            protected = {K[i] for i in op[2]}  # type: ignore[attr-defined]
            victims = policy.evict(index, lambda k, p=protected: k in p)
            allowed = resident - protected
            assert len(victims) == len(set(victims)) == min(index, len(allowed))
            assert set(victims) <= allowed
            resident -= set(victims)
        assert len(policy) == len(resident)
        policy.check_integrity(resident)


# -- LRU -------------------------------------------------------------------------
def test_lru_evicts_least_recently_used_first() -> None:
    policy = LRUPolicy(4)
    for key in K[:4]:
        policy.insert(key)
    policy.touch(K[0])
    policy.touch(K[2])
    assert policy.evict(4, never) == [K[1], K[3], K[0], K[2]]


# -- ARC -------------------------------------------------------------------------
def test_arc_second_use_moves_to_t2_and_ghost_hits_adapt_p() -> None:
    policy = ARCPolicy(4)
    for key in K[:4]:
        policy.insert(key)
    policy.touch(K[0])
    assert policy.sizes() == {"t1": 3, "t2": 1, "b1": 0, "b2": 0, "p": 0.0}
    assert policy.evict(1, never) == [K[1]], "T1 is over its target p=0: recency goes first"
    policy.insert(K[1])
    assert policy.sizes() == {"t1": 2, "t2": 2, "b1": 0, "b2": 0, "p": 1.0}, "B1 ghost: p grows"
    # |T1| = 2 > p = 1: K2 leaves T1; then |T1| = 1 = p: T2's oldest (K0) leaves.
    assert policy.evict(2, never) == [K[2], K[0]]
    assert policy.sizes() == {"t1": 1, "t2": 1, "b1": 1, "b2": 1, "p": 1.0}
    policy.insert(K[0])
    assert policy.p == 0.0 and policy.sizes()["t2"] == 2, "B2 ghost: p shrinks"
    assert policy.evict(1, lambda key: key == K[3]) == [K[1]], "T1 protected: fall back to T2"
    policy.check_integrity({K[0], K[3]})


def test_arc_ghosts_stay_bounded() -> None:
    policy = ARCPolicy(3)
    resident: set[bytes] = set()
    for key in K:
        if len(resident) == 3:
            resident -= set(policy.evict(1, never))
        policy.insert(key)
        resident.add(key)
        policy.touch(key)
        sizes = policy.sizes()
        assert sizes["t1"] + sizes["b1"] <= 3
        assert sizes["t1"] + sizes["t2"] + sizes["b1"] + sizes["b2"] <= 6
    policy.check_integrity(resident)


# -- S3-FIFO ---------------------------------------------------------------------
def test_s3fifo_one_hit_wonders_leave_through_the_small_queue() -> None:
    policy = S3FIFOPolicy(10)
    assert policy.small_target == 1 and policy.ghost_capacity == 9
    for key in K[:10]:
        policy.insert(key)
    for key in K[:5]:
        policy.touch(key)
    assert policy.evict(5, never) == K[5:10], "untouched keys go, touched ones move to main"
    assert policy.sizes() == {"small": 0, "main": 5, "ghost": 5}
    policy.insert(K[7])
    assert policy.sizes()["main"] == 6, "a ghost returns straight to main"
    policy.check_integrity({*K[:5], K[7]})


def test_s3fifo_main_gives_frequent_keys_extra_rounds() -> None:
    policy = S3FIFOPolicy(4, small_ratio=0.25)
    for key in K[:4]:
        policy.insert(key)
        policy.touch(key)
    for _ in range(5):
        policy.touch(K[0])
    policy.evict(1, never)  # the head of S moves to main; the next untouched one goes
    assert len(policy) == 3
    order = policy.evict(3, never)
    assert order[-1] == K[0], "K0 has the highest count, so it survives longest"


def test_s3fifo_retries_main_after_a_promotion() -> None:
    policy = S3FIFOPolicy(10, small_ratio=0.5)
    policy.insert(K[0])
    assert policy.evict(1, never) == [K[0]]
    policy.insert(K[0])  # back from the ghost queue: main = [K0]
    for key in K[1:4]:
        policy.insert(key)
    policy.touch(K[1])  # small = [K1 (used), K2, K3]
    pinned = {K[0], K[2]}
    # Main has only K0 (pinned); the small queue then promotes K1 to main and
    # gives up K3; the second victim must come from main again: K1.
    assert policy.evict(2, lambda key: key in pinned) == [K[3], K[1]]
    policy.check_integrity(pinned)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"small_ratio": 0.0}, "small_ratio"),
        ({"small_ratio": 1.0}, "small_ratio"),
        ({"promote_threshold": 0}, "promote_threshold"),
        ({"promote_threshold": 4}, "promote_threshold"),
    ],
)
def test_s3fifo_validation(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        S3FIFOPolicy(8, **kwargs)  # type: ignore[arg-type]


# -- admission ---------------------------------------------------------------------
def test_admission_needs_a_recent_second_offer() -> None:
    policy = AdmissionFilter(LRUPolicy(8), window=2)
    assert not policy.admit(K[0])
    assert policy.admit(K[0])
    assert not policy.admit(K[0]), "an admitted key starts over"
    for key in K[1:3]:
        policy.admit(key)
    assert not policy.admit(K[0]), "forgotten: two other sightings pushed it out"
    policy.check_integrity(set())


def test_admission_asks_the_inner_policy_too() -> None:
    class Refuses(LRUPolicy):
        def admit(self, key: bytes) -> bool:
            return False

    policy = AdmissionFilter(Refuses(4))
    assert not policy.admit(K[0]) and not policy.admit(K[0])


@pytest.mark.parametrize(("inner", "window"), [("lru", 0), ("lru", True), (None, 4)])
def test_admission_validation(inner: str | None, window: object) -> None:
    wrapped = LRUPolicy(4) if inner else object()
    with pytest.raises(ConfigError):
        AdmissionFilter(wrapped, window=window)  # type: ignore[arg-type]


# -- policies against each other -------------------------------------------------
def hot_hit_ratio(policy: EvictionPolicy, rounds: int = 20) -> float:
    """Four hot chunks used twice in a row every round, then ten chunks never seen again.

    Counts hits of each round's first use of a hot chunk: LRU always loses
    them to the scan; a policy that values reuse keeps them.
    """
    manager = OffloadIndex(8, policy)
    hits, scan = 0, iter(K[4:] * 1000)

    def use(key: bytes) -> bool:
        if manager.lookup([key]):
            manager.touch([key])
            return True
        store = manager.prepare_store([key])
        assert store is not None
        manager.complete_store(store.keys)
        return False

    for round_ in range(rounds):
        for key in K[:4]:
            hits += use(key) and round_ > 0
            use(key)
        for _ in range(10):
            use(next(scan))
        manager.check_integrity()
    return hits / (4 * (rounds - 1))


def test_scan_resistance() -> None:
    assert hot_hit_ratio(LRUPolicy(8)) == 0.0
    assert hot_hit_ratio(ARCPolicy(8)) > 0.8
    assert hot_hit_ratio(S3FIFOPolicy(8)) > 0.8
    assert hot_hit_ratio(AdmissionFilter(LRUPolicy(8), window=4)) > 0.8
    assert hot_hit_ratio(AdmissionFilter(ARCPolicy(8))) > 0.8


@pytest.mark.parametrize("sightings", [1, 0, True, 2.0])
def test_admission_filter_needs_at_least_two_sightings(sightings: object) -> None:
    with pytest.raises(ConfigError, match="sightings must be an int >= 2"):
        AdmissionFilter(LRUPolicy(4), sightings=sightings)  # type: ignore[arg-type]
