"""Tensor parallelism without an engine: replicated groups stored once, one shared CPU tier.

The spec table says which vLLM groups every rank holds alike; the layout and
the budgets count one copy of their chunks; the shared-memory region that an
engine's ranks map (its reservation, its refusal when /dev/shm is short, the
removal of what a crashed engine left); the lower tiers written in turns;
``kvoffload plan --world-size``. ``tests_e2e/test_tensor_parallel.py`` runs
all of it on vLLM at ``tensor_parallel_size=2``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kvoffload.cli import main
from kvoffload.config import build_offloading_config
from kvoffload.config.layout import CacheGroup, KVLayout
from kvoffload.errors import ConfigError
from kvoffload.keys import namespace_of
from kvoffload.tiers.cpu import CPUSlab, slab_bytes
from kvoffload.tiers.disk import DiskTier
from kvoffload.tiers.from_config import TakingTurns, rank_probes
from kvoffload.tiers.shared import SharedRegion, remove_stale
from kvoffload.vllm._layout import SPEC_TABLE, Action

MLA = CacheGroup("mla", 16, ("l0", "l1"), 1152 * 16, replicated=True)
GQA = CacheGroup("full", 16, ("l0", "l1"), 4096)


def test_the_spec_table_replicates_the_mla_family_only() -> None:
    replicated = {name for name, row in SPEC_TABLE.items() if row.replicated}
    assert replicated == {
        "MLAAttentionSpec", "MLAAttentionSpec/compressed", "HiddenStateCacheSpec",
        "SlidingWindowMLASpec",
    }  # fmt: skip
    for name in replicated:
        row = SPEC_TABLE[name]
        assert row.action is Action.SERVE and "replicated" in row.reason, name


def test_a_replicated_layout_holds_one_copy_of_each_chunk_in_the_budgets() -> None:
    budget = {"cpu_bytes_to_use": 1 << 20}
    for world in (1, 2, 8):
        mla = build_offloading_config(budget, KVLayout((MLA,)), world_size=world)
        gqa = build_offloading_config(budget, KVLayout((GQA,)), world_size=world)
        assert mla.copies == 1 and mla.num_cpu_chunks == (1 << 20) // MLA.chunk_bytes(1)
        assert gqa.copies == world and gqa.num_cpu_chunks == (1 << 20) // world // 8192
    mixed = KVLayout((MLA, CacheGroup("full", 16, ("l2",), 4096)))
    assert not mixed.replicated  # a sharded group beside it: one shard per rank, as before
    assert build_offloading_config(budget, mixed, world_size=2).copies == 2
    text = str(build_offloading_config(budget, KVLayout((MLA,)), world_size=2))
    assert "replicated groups: one copy, stored once, loaded by every rank" in text


def test_too_small_a_budget_names_the_copies() -> None:
    with pytest.raises(
        ConfigError, match=re.escape("2 worker(s) holding 2 copies of a chunk need at least 16384")
    ):
        build_offloading_config({"cpu_bytes_to_use": 9000}, KVLayout((GQA,)), world_size=2)
    one = build_offloading_config({"cpu_bytes_to_use": 1152 * 32}, KVLayout((MLA,)), world_size=8)
    assert one.num_cpu_chunks == 1  # a budget for one chunk holds it, however many ranks


def test_ranks_sharing_a_namespace_are_probed_once(tmp_path: Path) -> None:
    config = build_offloading_config(
        {"cpu_bytes_to_use": 1 << 20, "disk_path": str(tmp_path), "disk_bytes_to_use": 1 << 24},
        KVLayout((MLA,)),
        world_size=2,
    )
    ns = namespace_of("m", "bfloat16", config.layout)
    (probe,) = rank_probes(config, [ns, ns])
    assert type(probe).__name__ == "DiskProbe"
    (both,) = rank_probes(config, [ns, namespace_of("m#tp1", "bfloat16", config.layout)])
    assert type(both).__name__ == "AllRanksProbe"
    for p in (probe, both):
        p.close()


def test_shared_region_is_one_memory_for_every_rank_and_leaves_no_name(tmp_path: Path) -> None:
    created = SharedRegion.create(3 * 4096, tmp_path)
    other = SharedRegion.attach(created.path, 3 * 4096)  # what another rank maps
    assert created.owner and not other.owner
    slab_a = CPUSlab(3, 4000, pin_memory=False, buffer=created.tensor)
    slab_b = CPUSlab(3, 4000, pin_memory=False, buffer=other.tensor)
    slab_a.slot(1).fill_(9)
    assert (slab_b.slot_array(1) == 9).all() and not slab_b.slot_array(0).any()
    created.unlink()
    assert list(tmp_path.iterdir()) == []  # the name is gone, the memory still mapped
    slab_b.slot(2)[:10] = torch.arange(10, dtype=torch.uint8)
    assert np.array_equal(slab_a.slot_array(2, 10), np.arange(10))
    with pytest.raises(ConfigError, match="ranks disagree"):
        path = SharedRegion.create(4096, tmp_path).path
        SharedRegion.attach(path, 8192)


def test_a_slab_checks_the_buffer_it_is_given() -> None:
    assert slab_bytes(3, 4000) == 3 * 4096 and slab_bytes(2, 4097) == 4 * 4096
    with pytest.raises(ConfigError, match="at least 12288 bytes"):
        CPUSlab(3, 4000, pin_memory=False, buffer=torch.zeros(8192, dtype=torch.uint8))


def test_a_region_past_the_free_space_names_cpu_bytes_to_use(tmp_path: Path) -> None:
    fs = os.statvfs(tmp_path)
    free = fs.f_bavail * fs.f_frsize
    with pytest.raises(ConfigError) as caught:
        SharedRegion.create(free + (1 << 40), tmp_path)
    message = str(caught.value)
    assert "'cpu_bytes_to_use'" in message and f"{tmp_path}" in message
    assert "free; lower 'cpu_bytes_to_use'" in message
    assert list(tmp_path.iterdir()) == []


def test_a_crashed_engines_region_is_removed_at_the_next_start(tmp_path: Path) -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    stale = tmp_path / f"kvoffload-cpu-{gone.stdout.strip()}-abcdef"
    live = tmp_path / f"kvoffload-cpu-{os.getpid()}-123456"
    other = tmp_path / "kvoffload-cpu-notmine"
    for path in (stale, live, other):
        path.write_bytes(b"x")
    assert remove_stale(tmp_path) == [stale.name]
    region = SharedRegion.create(4096, tmp_path)  # creating cleans up too
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other.name,
                                                                 region.name])  # fmt: skip


def test_ranks_write_a_replicated_chunk_in_turns_and_all_read_it(tmp_path: Path) -> None:
    ns = b"n" * 16
    tiers = [TakingTurns(DiskTier(tmp_path, 1 << 24, ns), rank, 2) for rank in range(2)]
    keys = [bytes([i]) * 16 for i in range(6)]
    for key in keys:  # every rank runs every store, with the same bytes
        data = np.full(4096, key[0], dtype=np.uint8)
        for tier in tiers:
            tier.put(key, data)
    stores = [t.stats().stores for t in tiers]
    assert stores == [3, 3] and [t.others_turns for t in tiers] == [3, 3]  # each once
    assert len(list(tiers[0].tier.directory.glob("*.kv"))) == 6
    for tier in tiers:
        out = np.empty(4096, dtype=np.uint8)
        assert all(tier.get_into(k, out) and (out == k[0]).all() for k in keys)
    for tier in tiers:
        tier.close()


def test_plan_shows_what_the_tiers_hold_per_rank(capsys: pytest.CaptureFixture[str]) -> None:
    extra = json.dumps({"cpu_bytes_to_use": "64MiB"})
    assert main(["plan", "tiny_deepseek_v4", "--world-size", "4", "--extra-config", extra]) == 0
    mla = capsys.readouterr().out
    assert "Every group is replicated: each chunk is stored once for all 4 ranks" in mla
    assert "one copy, 4 ranks load it" in mla
    assert main(["plan", "tiny_llama", "--world-size", "4", "--extra-config", extra]) == 0
    gqa = capsys.readouterr().out
    assert "each of the 4 ranks stores its shard of every chunk" in gqa
    assert "4 shards, one per rank" in gqa
    assert main(["plan", "tiny_deepseek_v4", "--world-size", "4", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["chunk_copies"] == 1
    assert {g["tensor_parallel"] for g in plan["groups"]} == {"replicated"}


def test_plan_sizes_one_ranks_shard_and_the_whole_latent(
    capsys: pytest.CaptureFixture[str],
) -> None:
    def chunk_bytes(model: str, world: int) -> list[int]:
        assert main(["plan", model, "--world-size", str(world), "--json"]) == 0
        return [g["chunk_bytes"] for g in json.loads(capsys.readouterr().out)["groups"]]

    llama, llama2 = chunk_bytes("tiny_llama", 1), chunk_bytes("tiny_llama", 2)
    assert llama2 == [b // 2 for b in llama]  # each rank holds half the KV heads
    assert chunk_bytes("tiny_deepseek_v4", 4) == chunk_bytes("tiny_deepseek_v4", 1)
    qwen, qwen2 = chunk_bytes("tiny_qwen3_next", 1), chunk_bytes("tiny_qwen3_next", 2)
    assert qwen2[0] < qwen[0]  # a rank's recurrent state holds its heads only
