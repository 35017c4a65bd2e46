"""Lower-tier hits promoted into the CPU tier first, then loaded in the step that finds them.

``KVOFFLOAD_LOWER_TIER_HITS=promote`` (:mod:`kvoffload.connector.promotions`), on the
package's stand-in for vLLM with real CPU and disk tiers, files and engine tensors, as in
``test_vllm_scheduler.py``: every loaded block is checked bit-exact.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_vllm_scheduler import Rig, gemma_like, llama_like, rig, tokens

from kvoffload import OffloadConfig, build_offloading_config
from kvoffload.config.layout import KVLayout
from kvoffload.connector.loads import HitLoading, hit_loading
from kvoffload.connector.promotions import LOWER_TIER_HITS_ENV, promotes_lower_hits
from kvoffload.engine import JobKind
from kvoffload.errors import ConfigError, TransferError
from kvoffload.messages import NO_BLOCKS, BlockSpan, ChunkSpan


@pytest.fixture
def promote(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LOWER_TIER_HITS_ENV, "promote")


def on_disk(rigs: list[Rig], layout: KVLayout, tmp: Path, ids: list[int], **extra: Any) -> Rig:
    """A fresh process's connector over a disk tier another one filled with ``ids``' chunks."""
    writer = Rig(layout, tmp, **extra)
    writer.serve("writer", ids)
    writer.close()
    return rig(rigs, layout, tmp, probes=True, **extra)


def test_a_promoted_hit_loads_in_the_step_that_finds_it_in_the_cpu_tier(
    promote: None, rigs: list[Rig], tmp_path: Path
) -> None:
    ids = tokens(70)
    r = on_disk(rigs, llama_like(), tmp_path, ids)
    sched = r.scheduler
    assert r.lookup("a", ids) is None  # ask again: the chunks are being read in
    [order] = sched.take_orders()
    assert order.kind is JobKind.PROMOTE and all(s.blocks is NO_BLOCKS for s in order.spans)
    assert r.lookup("a", ids) is None  # still on their way: nothing ordered twice
    assert sched.take_orders() == []
    r.worker.submit([order], JobKind.LOAD)  # promotions start with the step's loads
    r.drain()
    offered = r.lookup("a", ids)
    assert offered == r.top_hit(70) and sched.loads_in_step("a")
    assert not sched.loads_from_lower_tier("a")  # every chunk is in the CPU tier now
    stats = sched.stats()
    assert stats["promotions"] == 1 and stats["promoted_chunks"] == len(order.keys)
    assert stats["failed_promoted_chunks"] == 0 and stats["index_storing"] == 0
    worker = r.worker.stats()
    assert worker["promote_jobs"] == 1 and worker["promoted_chunks"] == len(order.keys)
    assert worker["tiers"]["disk"]["loads"] == len(order.keys)


def test_a_promoted_hit_is_served_bit_exact_and_counted_for_the_tier_it_came_from(
    promote: None, rigs: list[Rig], tmp_path: Path
) -> None:
    ids = tokens(70)
    r = on_disk(rigs, llama_like(), tmp_path, ids)
    served = r.serve("r1", ids)
    assert served.offered == served.loaded == r.top_hit(70) > 0
    assert served.verified > 0 and served.mismatched == served.failed == 0
    stats, worker = r.scheduler.stats(), r.worker.stats()
    assert stats["promotions"] == 1 and stats["hit_requests"] == 1
    assert stats["in_step_hit_tokens"] == stats["hit_tokens"] == served.offered  # once
    assert stats["hit_tokens_by_tier"] == {"disk": served.offered}
    assert stats["lower_hit_chunks"] == stats["promoted_chunks"] and stats["cpu_hit_chunks"] == 0
    assert worker["in_step_load_jobs"] == 1 and worker["promote_jobs"] == 1
    # Now CPU-tier chunks: the next request loads them in its step with no promotion.
    again = r.serve("r2", ids)
    assert again.loaded == served.loaded and r.scheduler.stats()["promotions"] == 1
    assert r.scheduler.stats()["hit_tokens_by_tier"]["cpu"] == again.offered


def test_a_failed_promotion_is_reported_and_the_request_recomputed(
    promote: None, rigs: list[Rig], tmp_path: Path
) -> None:
    ids = tokens(70)
    writer = Rig(llama_like(), tmp_path)
    writer.serve("writer", ids)
    writer.close()
    for path in tmp_path.rglob("*.kv"):
        with path.open("r+b") as f:
            f.seek(4096 + 10)
            f.write(b"\x00\xff" * 8)
    r = rig(rigs, llama_like(), tmp_path, probes=True)
    served = r.serve("r1", ids)
    # Nothing damaged reaches the engine: the request promotes once, and what the
    # promotion could not read is recomputed (never offered again, or failed by block).
    assert served.loaded == 0 and served.mismatched == 0
    stats = r.scheduler.stats()
    assert stats["promotions"] == 1 and stats["promoted_chunks"] == 0
    assert stats["failed_promoted_chunks"] == r.top_hit(70) // 8
    assert stats["index_pinned"] == 0 and stats["index_storing"] == 0
    r.scheduler.index.check_integrity()
    # What the engine computed was stored again: the next request loads it, right.
    third = r.serve("r2", ids)
    assert third.loaded == third.offered == r.top_hit(70) and third.mismatched == 0


@pytest.mark.parametrize(("setting", "promotes"), [("auto", False), ("always", True)])
def test_only_hits_that_load_in_their_step_are_promoted(
    promote: None, rigs: list[Rig], tmp_path: Path, setting: str, promotes: bool
) -> None:
    """Several groups: by default a hit loads a step later anyway, so it is not promoted."""
    ids = tokens(70)
    r = on_disk(rigs, gemma_like(), tmp_path, ids, load_in_step=setting)
    served = r.serve("r1", ids)
    assert served.offered == served.loaded > 0 and served.mismatched == 0
    stats = r.scheduler.stats()
    assert stats["promotions"] == int(promotes)
    assert stats["in_step_hit_tokens"] == (served.offered if promotes else 0)


def test_the_default_loads_lower_tier_hits_over_later_steps(
    rigs: list[Rig], tmp_path: Path
) -> None:
    ids = tokens(70)
    r = on_disk(rigs, llama_like(), tmp_path, ids)
    assert r.lookup("a", ids) == r.top_hit(70) and not r.scheduler.loads_in_step("a")
    assert r.scheduler.loads_from_lower_tier("a")  # vLLM 0.34 may start it while busy
    assert r.scheduler.stats()["promotions"] == 0


def test_the_setting_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LOWER_TIER_HITS_ENV, "prefetch")
    with pytest.raises(ConfigError, match=f"{LOWER_TIER_HITS_ENV}='prefetch'.*load or promote"):
        promotes_lower_hits()
    with pytest.raises(ConfigError, match=f"{LOWER_TIER_HITS_ENV}='prefetch'"):
        hit_loading(config_of("never"), 1)  # checked where no hit loads in its step too
    monkeypatch.setenv(LOWER_TIER_HITS_ENV, " Promote ")
    assert promotes_lower_hits()
    assert hit_loading(config_of("always"), 1) is HitLoading.PROMOTE_FIRST
    assert hit_loading(config_of("never"), 1) is HitLoading.LATER  # nothing to promote for
    monkeypatch.delenv(LOWER_TIER_HITS_ENV)
    assert hit_loading(config_of("always"), 1) is HitLoading.IN_STEP


def config_of(load_in_step: str) -> OffloadConfig:
    settings = {"cpu_bytes_to_use": "1MiB", "load_in_step": load_in_step}
    return build_offloading_config(settings, llama_like())


def test_a_promotion_moves_no_engine_blocks(rigs: list[Rig], tmp_path: Path) -> None:
    r = rig(rigs, llama_like(), tmp_path)
    span = ChunkSpan(0, (b"k" * 16,), (0,), BlockSpan((1, 2)))
    with pytest.raises(TransferError, match="a promotion moves no engine blocks"):
        r.worker.engine.submit_promote([span])
    assert r.worker.engine.wait(timeout=5) and r.worker.engine.get_finished() == []
