"""The CPU tier: slot-addressed hot path and key-addressed Tier contract on one slab."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from kvoffload.errors import ConfigError, TierError
from kvoffload.registry import TIERS
from kvoffload.tiers.cpu import CPUTier


def chunk(value: int, n: int = 64) -> np.ndarray:
    return np.full(n, value, dtype=np.uint8)


def test_registry_builds_it() -> None:
    tier = TIERS.create("cpu", 4, 64)
    assert isinstance(tier, CPUTier)
    assert tier.slab.shape == (4, 64)
    assert tier.pinned == torch.cuda.is_available()


def test_put_get_round_trip_and_contract() -> None:
    tier = CPUTier(2, 64)
    tier.put(b"a", chunk(1, 40))
    out = np.zeros(40, dtype=np.uint8)
    tier.get_into(b"a", out)
    assert (out == 1).all()
    assert tier.contains(b"a") and not tier.contains(b"b")
    with pytest.raises(TierError, match="has 40 bytes"):
        tier.get_into(b"a", np.zeros(64, dtype=np.uint8))
    with pytest.raises(TierError, match="does not hold"):
        tier.get_into(b"b", out)
    tier.put(b"a", chunk(2, 40))  # overwrite in place, same slot
    tier.get_into(b"a", out)
    assert (out == 2).all() and tier.stats()["chunks"] == 1
    tier.discard(b"a")
    tier.discard(b"never")  # unknown keys are ignored
    assert not tier.contains(b"a")
    tier.check_integrity()


def test_put_never_evicts() -> None:
    tier = CPUTier(2, 64)
    tier.put(b"a", chunk(1))
    tier.put(b"b", chunk(2))
    with pytest.raises(TierError, match="full"):
        tier.put(b"c", chunk(3))
    assert tier.contains(b"a") and tier.contains(b"b")
    assert tier.stats()["put_failures"] == 1


def test_put_refuses_oversized_or_wrong_dtype() -> None:
    tier = CPUTier(2, 64)
    with pytest.raises(TierError, match=r"1\.\.64 bytes"):
        tier.put(b"a", chunk(1, 65))
    with pytest.raises(TierError, match="uint8"):
        tier.put(b"a", np.zeros(4, dtype=np.int32))


def test_slot_path_writes_in_place_and_binds() -> None:
    tier = CPUTier(3, 64)
    view = tier.slot(1, 32)
    view.fill_(7)  # what a gather does: write the slab memory directly
    assert tier.bind(b"k", 1, 32) is None
    assert tier.slot_of(b"k") == 1 and tier.key_at(1) == b"k" and tier.holds(b"k", 1)
    out = np.zeros(32, dtype=np.uint8)
    tier.get_into(b"k", out)  # the same chunk through the key-addressed contract
    assert (out == 7).all()
    assert np.shares_memory(tier.slot_array(1), tier.slab.numpy())
    tier.check_integrity()


def test_reserve_unbinds_and_protects_the_slot() -> None:
    tier = CPUTier(1, 64)
    tier.bind(b"old", 0, 64)
    assert tier.reserve(0) == b"old"
    assert not tier.contains(b"old")
    with pytest.raises(TierError, match="full"):  # a reserved slot is not free
        tier.put(b"x", chunk(1))
    tier.check_integrity()
    assert tier.release(0) is None
    tier.put(b"x", chunk(1))  # released: free again
    tier.check_integrity()


def test_bind_displaces_and_moves_keys() -> None:
    tier = CPUTier(3, 64)
    tier.bind(b"a", 0, 64)
    assert tier.bind(b"b", 0, 64) == b"a"  # the index evicted a, b took its slot
    assert not tier.contains(b"a")
    tier.bind(b"b", 2, 64)  # b moved: slot 0 is free again
    assert tier.key_at(0) is None and tier.slot_of(b"b") == 2
    assert tier.stats()["free_slots"] == 2
    tier.check_integrity()


def test_bad_slots_and_sizes() -> None:
    tier = CPUTier(2, 64)
    for slot in (-1, 2, True):
        with pytest.raises(TierError, match="slot"):
            tier.slot(slot)
    with pytest.raises(TierError, match="does not fit"):
        tier.bind(b"a", 0, 65)
    with pytest.raises(ConfigError, match="num_slots"):
        CPUTier(0, 64)
    with pytest.raises(ConfigError, match="slot_bytes"):
        CPUTier(1, 2.5)  # type: ignore[arg-type]


def test_integrity_reports_disagreement() -> None:
    tier = CPUTier(2, 64)
    tier.bind(b"a", 0, 64)
    tier._key_at[0] = b"zzz"  # break it on purpose
    with pytest.raises(TierError, match="disagree"):
        tier.check_integrity()


def test_close_is_idempotent_and_refuses_use() -> None:
    tier = CPUTier(2, 64)
    tier.put(b"a", chunk(1))
    tier.close()
    tier.close()
    with pytest.raises(TierError, match="closed"):
        tier.put(b"a", chunk(1))
    assert not tier.contains(b"a")


def test_concurrent_puts_and_gets_are_atomic() -> None:
    tier = CPUTier(8, 4096)
    errors: list[str] = []

    def worker(i: int) -> None:
        key = bytes([i])
        out = np.empty(4096, dtype=np.uint8)
        for round_ in range(200):
            tier.put(key, chunk((i * 31 + round_) % 256, 4096))
            tier.get_into(key, out)
            if not (out == out[0]).all():
                errors.append(f"torn chunk for {i}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    tier.check_integrity()
    assert tier.stats()["puts"] == 800


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinning works with CUDA")
def test_pinning_without_cuda_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="pinned"):
        CPUTier(1, 64, pin_memory=True)
