"""Per-tenant shares of the CPU tier, on the real index, with every registered policy.

A tenant is what ``prepare_store`` is told (the connector passes the cache
salt). With ``tenant_share`` set no tenant holds more than its cap of the
slots: a tenant at its cap makes room from its own chunks, so one tenant
flooding the tier cannot evict everyone else. A stateful test drives random
interleavings for every policy and checks the rule and the index's
integrity after every step.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvoffload import CacheGroup, KVLayout, build_offloading_config
from kvoffload.errors import ConfigError, KVOffloadError
from kvoffload.manager import AdmissionFilter, EventKind, OffloadIndex
from kvoffload.manager.results import StoreResult
from kvoffload.registry import POLICIES

POLICY_NAMES = POLICIES.names()
TENANTS: tuple[str | None, ...] = ("alice", "bob", None)


def keys_of(tenant: str | None, n: int, start: int = 0) -> list[bytes]:
    """``n`` distinct keys of ``tenant`` (a salted chunk never shares a key with another salt)."""
    tag = (tenant or "-").encode()
    return [tag.ljust(8, b".") + i.to_bytes(8, "big") for i in range(start, start + n)]


def store(manager: OffloadIndex, keys: list[bytes], tenant: str | None) -> list[bytes]:
    """Store ``keys`` for ``tenant``; returns what it evicted."""
    result = manager.prepare_store(keys, tenant=tenant)
    assert result is not None
    manager.complete_store(result.keys)
    manager.check_integrity()
    return list(result.evicted)


@pytest.fixture(params=POLICY_NAMES)
def policy(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


def test_a_flooding_tenant_evicts_only_its_own_chunks(policy: str) -> None:
    manager = OffloadIndex(10, policy, tenant_share=0.5)
    bob = keys_of("bob", 4)
    store(manager, bob, "bob")
    for start in range(0, 40, 3):  # alice stores 40 chunks, 3 at a time
        evicted = store(manager, keys_of("alice", 3, start), "alice")
        assert not set(evicted) & set(bob), f"alice evicted bob's chunks with {policy}"
        assert manager.tenants is not None
        assert manager.tenants.held()["alice"] <= 5
    assert manager.lookup(bob) == 4  # every chunk of bob's is still there
    assert manager.tenants is not None
    assert manager.tenants.held() == {"alice": 5, "bob": 4}


def test_without_shares_the_flood_takes_everything(policy: str) -> None:
    """The same traffic without the setting: the check above is not vacuous."""
    manager = OffloadIndex(10, policy)
    bob = keys_of("bob", 4)
    result = manager.prepare_store(bob, tenant="bob")
    assert result is not None
    manager.complete_store(result.keys)
    for start in range(0, 40, 3):
        result = manager.prepare_store(keys_of("alice", 3, start), tenant="alice")
        assert result is not None
        manager.complete_store(result.keys)
    assert manager.lookup(bob) < 4
    assert manager.tenants is None


def test_a_tenant_below_its_cap_may_take_free_and_others_room(policy: str) -> None:
    """The cap limits each tenant; it does not reserve room for anyone."""
    manager = OffloadIndex(8, policy, tenant_share=0.5)
    store(manager, keys_of("bob", 4), "bob")
    store(manager, keys_of(None, 4), None)  # the unsalted requests are a tenant too
    evicted = store(manager, keys_of("alice", 2), "alice")
    assert len(evicted) == 2 and all(not k.startswith(b"alice") for k in evicted)
    assert manager.tenants is not None
    assert manager.tenants.held()["alice"] == 2


def test_a_store_bigger_than_the_cap_or_pinned_own_chunks_is_refused(policy: str) -> None:
    manager = OffloadIndex(8, policy, tenant_share=0.25)  # cap: 2 chunks
    assert manager.prepare_store(keys_of("alice", 3), tenant="alice") is None
    alice = keys_of("alice", 2)
    store(manager, alice, "alice")
    manager.prepare_load(alice)  # both pinned: alice cannot make room
    before = manager.stats()
    assert manager.prepare_store(keys_of("alice", 1, 10), tenant="alice") is None
    assert manager.stats() == before
    # bob is not bound by alice's pins, and alice's chunks stay
    store(manager, keys_of("bob", 2), "bob")
    manager.complete_load(alice)
    evicted = store(manager, keys_of("alice", 1, 10), "alice")
    assert len(evicted) == 1 and evicted[0] in alice


def test_a_store_never_evicts_the_chunks_it_found(policy: str) -> None:
    """The tenant's chunks the store itself asked for are protected, as without shares."""
    manager = OffloadIndex(8, policy, tenant_share=0.25)
    alice = keys_of("alice", 2)
    store(manager, alice, "alice")
    assert manager.prepare_store([*alice, *keys_of("alice", 1, 5)], tenant="alice") is None
    evicted = store(manager, [alice[1], *keys_of("alice", 1, 5)], "alice")
    assert evicted == [alice[0]]


def test_failed_stores_reset_and_events_keep_the_counts(policy: str) -> None:
    manager = OffloadIndex(8, policy, tenant_share=0.5)
    result = manager.prepare_store(keys_of("alice", 3), tenant="alice")
    assert result is not None
    manager.abort_store(result.keys)
    manager.check_integrity()
    assert manager.tenants is not None and manager.tenants.held() == {}
    store(manager, keys_of("alice", 4), "alice")
    store(manager, keys_of("bob", 2), "bob")
    manager.prepare_load(keys_of("bob", 1))
    manager.take_events()
    manager.reset()
    manager.check_integrity()
    assert manager.tenants.held() == {"bob": 1}  # the pinned chunk survives the reset
    removed = [e for e in manager.take_events() if e.kind is EventKind.REMOVED]
    assert len(removed) == 5


def test_admission_filters_and_promotions_obey_the_cap() -> None:
    manager = OffloadIndex(8, AdmissionFilter(POLICIES.create("lru", 8), sightings=2),
                             tenant_share=0.25)  # fmt: skip
    keys = keys_of("alice", 2)
    assert manager.prepare_store(keys, tenant="alice") == StoreResult((), (), ())  # first sight
    store(manager, keys, "alice")
    evicted = store(manager, keys_of("alice", 1, 9), "alice")  # admitted? needs a second sight
    assert evicted == []
    result = manager.prepare_promotion(keys_of("alice", 1, 9), tenant="alice")
    assert result is not None and len(result.evicted) == 1
    manager.complete_store(result.keys)
    manager.check_integrity()


def test_the_key_table_reads_the_share_and_the_index_uses_it() -> None:
    layout = KVLayout((CacheGroup("full", 16, ("l0",), 4096),))
    config = build_offloading_config(
        {"cpu_bytes_to_use": 40 * 4096, "tenant_cpu_share": "0.25"}, layout
    )
    assert config.tenant_cpu_share == 0.25
    manager = OffloadIndex.from_config(config)
    assert manager.tenants is not None and manager.tenants.cap == 10
    assert "0.25 of the CPU tier per tenant" in str(config)
    for bad in (0, "0", 1.5, "half", True, float("nan"), -0.1, 10**400):  # 10**400: no float
        with pytest.raises(ConfigError, match="'tenant_cpu_share' must be a fraction"):
            build_offloading_config({"cpu_bytes_to_use": 4096, "tenant_cpu_share": bad}, layout)
    with pytest.raises(KVOffloadError, match=r"tenant share must be in \(0, 1\]"):
        OffloadIndex(4, tenant_share=2.0)


CAPACITY = 6
SHARE = 0.5  # cap 3
KEYS = {t: keys_of(t, 6) for t in TENANTS}
tenant_st = st.sampled_from(TENANTS)


class SharesMachine(RuleBasedStateMachine):
    """Random stores, loads, failures and resets; the caps hold and counts stay exact."""

    policy = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.manager = OffloadIndex(CAPACITY, self.policy, tenant_share=SHARE)
        self.pins: Counter[bytes] = Counter()
        self.storing: dict[bytes, str | None] = {}

    def owner(self, key: bytes) -> str | None:
        return next(t for t, keys in KEYS.items() if key in keys)

    @rule(tenant=tenant_st, data=st.data(), complete=st.booleans())
    def prepare_store(self, tenant: str | None, data: st.DataObject, complete: bool) -> None:
        keys = data.draw(st.lists(st.sampled_from(KEYS[tenant]), max_size=4))
        before = dict(self.manager._ready)
        result = self.manager.prepare_store(keys, tenant=tenant)
        if result is None:
            return
        for victim in result.evicted:
            assert victim in before and not self.pins[victim]
            if self.owner(victim) != tenant:
                # another tenant's chunk goes only when the tier has no free slot left
                assert len(before) + len(self.storing) + len(result.keys) > CAPACITY
        if complete:
            self.manager.complete_store(result.keys)
        else:
            self.storing.update(dict.fromkeys(result.keys, tenant))

    @precondition(lambda self: self.storing)
    @rule(success=st.booleans())
    def complete_store(self, success: bool) -> None:
        keys, self.storing = list(self.storing), {}
        if success:
            self.manager.complete_store(keys)
        else:
            self.manager.abort_store(keys)

    @precondition(lambda self: self.manager._ready)
    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.manager._ready)))
        self.manager.prepare_load([key])
        self.pins[key] += 1

    @precondition(lambda self: +self.pins)
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(+self.pins)))
        self.manager.complete_load([key])
        self.pins[key] -= 1

    @rule()
    def reset(self) -> None:
        self.manager.reset()

    @invariant()
    def caps_hold_and_counts_agree(self) -> None:
        self.manager.check_integrity()  # tenant counts against the index, and every cap
        assert self.manager.tenants is not None
        held = self.manager.tenants.held()
        assert all(n <= self.manager.tenants.cap for n in held.values()), held


@pytest.mark.parametrize("policy_name", POLICY_NAMES)
def test_shares_state_machine(policy_name: str) -> None:
    machine = type(f"Shares_{policy_name}", (SharesMachine,), {"policy": policy_name})
    run = settings(
        max_examples=60, stateful_step_count=30, deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )(machine).TestCase  # fmt: skip
    run().runTest()
