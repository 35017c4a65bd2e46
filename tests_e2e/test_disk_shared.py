"""Two vLLM engines at once on one ``disk_path``: each loads what the other stored, and the
two together stay within the one budget the directory has (``disk_bytes_to_use``).

The two store at the same time (two processes, one SQLite index, one LRU order), each
its own prompts; the budget is smaller than what they store together, so stores evict.
Then two fresh processes, again at once, each ask for a prompt the other stored: their
CPU tiers are empty, so every hit is a chunk the other engine wrote.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from _harness import (
    LLAMA_ENGINE,
    Engine,
    Reference,
    assert_same_output,
    differences,
    random_prompts,
    with_disk,
)
from _models import LLAMA, kv_bytes_per_token

#: A chunk file of the Llama at blocks_per_chunk 1: a 4 KiB header and 32 tokens of KV.
FILE_BYTES = 4096 + 32 * kv_bytes_per_token(LLAMA)
#: Four prompts of 10 full blocks, nothing shared: 40 chunk files stored, 30 fit.
PROMPTS = random_prompts(4, 320, 512, seed=11)
BUDGET = 30 * FILE_BYTES
#: The storing engines' schedule, for vLLM alone too: on CPUs with AMX a prompt's logprobs
#: follow what is batched with it (0.004 apart between alone and a batch of four, measured).
ONE_BY_ONE: list[dict[str, Any]] = [{"one_by_one": True}]


def disk_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*.kv"))


def test_two_engines_at_once_load_each_others_chunks_within_one_budget(
    engine: Engine, reference: Reference, llama: str, tmp_path: Path
) -> None:
    halves = [PROMPTS[:2], PROMPTS[2:]]
    connector = with_disk(tmp_path / "kv", str(BUDGET), blocks_per_chunk=1,
                          cpu_bytes_to_use="64MiB")  # fmt: skip

    def both(order: list[list[list[int]]], *, one_by_one: bool) -> list[dict[str, Any]]:
        def one(prompts: list[list[int]]) -> dict[str, Any]:
            return engine(model=llama, engine=LLAMA_ENGINE, prompts=prompts, connector=connector,
                          passes=[{"one_by_one": one_by_one}])  # fmt: skip

        with ThreadPoolExecutor(2) as pool:  # two engine processes running at once
            return list(pool.map(one, order))

    # One prompt at a time: the ten chunks the budget evicts are the oldest, of a first
    # prompt, so each engine's second prompt stays whole for the other to load.
    stored = both(halves, one_by_one=True)
    for result, half in zip(stored, halves, strict=True):
        # vLLM alone computing the same way (see ONE_BY_ONE)
        alone = engine(model=llama, engine=LLAMA_ENGINE, prompts=half, passes=ONE_BY_ONE)
        assert_same_output(result, alone)
        assert result["stats"]["scheduler"]["stored_chunks"] == 20
    sizes = {p.stat().st_size for p in (tmp_path / "kv").rglob("*.kv")}
    assert sizes == {FILE_BYTES}, sizes
    assert disk_bytes(tmp_path / "kv") <= BUDGET  # 40 chunks stored, at most 30 kept
    assert sum(r["stats"]["worker"]["tiers"]["disk"]["evictions"] for r in stored) == 10

    # Then each engine asks for the other's second prompt, which no eviction reached (its
    # first prompt's chunks are all older). It loads the other's chunks and adds none: it
    # stores again only its last block (vLLM computes at least one token), which the disk
    # holds, so nothing is written or evicted, and its output ends short of another chunk.
    # What the other engine is about to look up stays, as it would not if a first prompt
    # (partly evicted) were recomputed and stored again, racing the other's lookup.
    whole = [[PROMPTS[3]], [PROMPTS[1]]]
    swapped = both(whole, one_by_one=False)
    for result, asked in zip(swapped, whole, strict=True):
        own_cache = reference(llama, LLAMA_ENGINE, asked)["passes"][1]  # vLLM's cache, 288
        found = differences(result["passes"][0], own_cache)
        assert not found, "; ".join(found)
        assert result["passes"][0]["cached"] == own_cache["cached"] == [288]
        scheduler, worker = result["stats"]["scheduler"], result["stats"]["worker"]
        assert scheduler["lower_hit_chunks"] == 9  # the other engine's chunks
        assert worker["tiers"]["disk"]["loads"] == 9
        assert scheduler["loaded_tokens"] == 288
        assert scheduler["failed_loads"] == 0
        assert worker["tiers"]["disk"]["already_held"] == 1  # the last block
        assert worker["tiers"]["disk"]["evictions"] == 0
    assert disk_bytes(tmp_path / "kv") <= BUDGET
