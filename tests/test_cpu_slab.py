"""The CPU slab: slot views the engine copies through, and the record of which key is where."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvoffload.errors import ConfigError, IntegrityError, TierError
from kvoffload.registry import TIERS
from kvoffload.tiers.cpu import CPUSlab


def test_it_is_no_registered_tier_and_has_page_aligned_slots() -> None:
    assert "cpu" not in TIERS  # always first, addressed by slot: nothing to choose
    slab = CPUSlab(4, 100)
    assert slab.slab.shape == (4, 100)
    assert slab.pinned == torch.cuda.is_available()
    assert all(slab.slot(s).data_ptr() % 4096 == 0 for s in range(4))


def test_slot_views_are_the_slab_memory() -> None:
    slab = CPUSlab(3, 64)
    tail, others = slab.slot_array(1)[32:].copy(), slab.slot_array(2).copy()
    view = slab.slot(1, 32)
    view.fill_(7)  # what a gather does: write the slab memory directly
    assert np.shares_memory(slab.slot_array(1), slab.slab.numpy())
    assert (slab.slot_array(1, 32) == 7).all()
    assert np.array_equal(slab.slot_array(1)[32:], tail)  # only the view was written
    assert np.array_equal(slab.slot_array(2), others)
    assert slab.slot(1).shape == (64,) and slab.slot_array(2, 10).shape == (10,)


def test_bind_records_the_key_and_holds_checks_it() -> None:
    slab = CPUSlab(3, 64)
    assert slab.reserve(1) is None
    assert not slab.holds(b"k", 1)  # reserved: being written, holds nothing yet
    assert slab.bind(b"k", 1, 32) is None
    assert slab.holds(b"k", 1) and not slab.holds(b"k", 0) and not slab.holds(b"j", 1)
    stats = slab.stats()
    assert (stats.chunks, stats.used_bytes, stats.capacity_bytes) == (1, 32, 3 * 64)
    assert stats.gauges["free_slots"] == 2
    slab.check_integrity()


def test_reserve_forgets_the_old_key_and_release_frees_the_slot() -> None:
    slab = CPUSlab(2, 64)
    slab.bind(b"old", 0, 64)
    assert slab.reserve(0) == b"old"  # about to be overwritten
    assert not slab.holds(b"old", 0)
    stats = slab.stats()
    assert stats.chunks == 0 and stats.used_bytes == 0 and stats.gauges["free_slots"] == 1
    slab.check_integrity()
    assert slab.release(0) is None  # the write failed: the slot holds nothing
    assert slab.stats().gauges["free_slots"] == 2
    slab.bind(b"new", 0, 64)
    assert slab.release(0) == b"new" and not slab.holds(b"new", 0)
    slab.check_integrity()


def test_bind_displaces_and_moves_keys() -> None:
    slab = CPUSlab(3, 64)
    slab.bind(b"a", 0, 64)
    assert slab.bind(b"b", 0, 16) == b"a"  # the index evicted a, b took its slot
    assert not slab.holds(b"a", 0)
    assert slab.bind(b"b", 2, 48) is None  # b moved: slot 0 holds nothing now
    assert not slab.holds(b"b", 0) and slab.holds(b"b", 2)
    stats = slab.stats()
    assert (stats.chunks, stats.used_bytes, stats.gauges["free_slots"]) == (1, 48, 2)
    slab.check_integrity()


def test_bad_slots_and_sizes() -> None:
    slab = CPUSlab(2, 64)
    for slot in (-1, 2, True):
        with pytest.raises(TierError, match="slot"):
            slab.slot(slot)
        with pytest.raises(TierError, match="slot"):
            slab.reserve(slot)
    with pytest.raises(TierError, match="does not fit"):
        slab.bind(b"a", 0, 65)
    with pytest.raises(TierError, match="does not fit"):
        slab.bind(b"a", 0, 0)
    with pytest.raises(ConfigError, match="num_slots"):
        CPUSlab(0, 64)
    with pytest.raises(ConfigError, match="slot_bytes"):
        CPUSlab(1, 2.5)  # type: ignore[arg-type]


def test_integrity_reports_disagreement_with_numbers() -> None:
    slab = CPUSlab(2, 64)
    slab.bind(b"a", 0, 64)
    slab._key_at[0] = b"zzz"  # break it on purpose
    with pytest.raises(IntegrityError, match="1 slots bound but 1 keys mapped, 2 entries disagree"):
        slab.check_integrity()


def test_close_forgets_every_chunk() -> None:
    slab = CPUSlab(2, 64)
    slab.bind(b"a", 0, 64)
    slab.reserve(1)
    slab.close()
    slab.close()
    assert not slab.holds(b"a", 0)
    stats = slab.stats()
    assert (stats.chunks, stats.used_bytes, stats.gauges["free_slots"]) == (0, 0, 2)
    slab.check_integrity()


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinning works with CUDA")
def test_pinning_without_cuda_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="pinned"):
        CPUSlab(1, 64, pin_memory=True)
