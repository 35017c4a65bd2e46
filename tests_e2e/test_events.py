"""The connector's KV events, as a router receives them from vLLM's ZMQ publisher.

A router has already indexed the GPU's ``BlockStored`` events; the CPU
tier's must name the same blocks: vLLM's block hashes (64-bit ints), the
same token ids per block, the engine's block size, a parent the router has
seen, the salt and adapter in ``extra_keys`` / ``lora_id`` / ``lora_name``, and a
``BlockRemoved`` with the same hashes when the CPU tier drops the chunk: on a reset
and on an ordinary eviction (a CPU tier of 16 chunks, 15 stored, then 10 more).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from _harness import LLAMA_ENGINE, LLAMA_PROMPTS, Engine, random_prompts
from _models import LLAMA, build_lora_adapter, kv_bytes_per_token

BLOCK = 32
#: One chunk of two 32-token Llama blocks, in bytes (the CPU tier's unit here).
CHUNK_BYTES = 2 * BLOCK * kv_bytes_per_token(LLAMA)


def gpu_blocks(events: list[dict[str, Any]]) -> dict[int, list[int]]:
    """vLLM's GPU blocks announced: hash -> the block's token ids."""
    blocks: dict[int, list[int]] = {}
    for event in events:
        if event["type"] == "BlockStored" and event["medium"] == "GPU":
            tokens = event["token_ids"]
            for i, block_hash in enumerate(event["block_hashes"]):
                blocks[block_hash] = tokens[i * BLOCK : (i + 1) * BLOCK]
    return blocks


def cpu_events(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == kind and e.get("medium") == "CPU"]


def hashes_of(events: list[dict[str, Any]]) -> list[int]:
    return sorted(h for e in events for h in e["block_hashes"])


def test_cpu_chunks_are_announced_as_the_gpu_blocks_they_copy(
    engine: Engine, llama: str, models: Path
) -> None:
    adapter = build_lora_adapter(Path(llama), models / "lora_a", seed=1)
    salted = {"prompt_token_ids": LLAMA_PROMPTS[1], "cache_salt": "tenant-a"}
    with_lora = {"prompt_token_ids": LLAMA_PROMPTS[2], "lora": ["a", 7, str(adapter)]}
    prompts = [LLAMA_PROMPTS[0], salted, with_lora]
    # 15 chunks stored (3 prompts of 5 two-block chunks, none shared: salt and adapter key
    # them apart) fit in 16; the last pass's 10 new chunks evict 9 of them.
    fresh = random_prompts(2, 320, vocab=512, seed=7)
    result = engine(
        model=llama,
        engine={**LLAMA_ENGINE, "enable_lora": True, "max_lora_rank": 8, "max_loras": 2},
        prompts=prompts,
        passes=[{}, {"reset_connector": True}, {"prompts": fresh}],
        connector={"blocks_per_chunk": 2, "cpu_bytes_to_use": 16 * CHUNK_BYTES},
        kv_events=True,
    )
    assert result["error"] is None, result["error"]
    first = result["passes"][0]["events"]
    gpu = gpu_blocks(first)
    stored = cpu_events(first, "BlockStored")
    assert gpu and stored
    chunks = result["passes"][0]["stats"]["scheduler"]["stored_chunks"]
    assert len(stored) == chunks == 15  # one event per chunk, every chunk
    for event in stored:
        hashes = event["block_hashes"]
        assert event["block_size"] == BLOCK and len(hashes) == 2
        assert all(isinstance(h, int) for h in hashes)
        tokens = event["token_ids"]
        assert [tokens[:BLOCK], tokens[BLOCK:]] == [gpu[h] for h in hashes]  # same identity
        parent = event["parent_block_hash"]
        assert parent is None or parent in gpu  # a parent the router has seen
        assert event["group_idx"] == 0 and event["kv_cache_spec_kind"] == "full_attention"
    salted_events = [e for e in stored if e["extra_keys"][0] == ["tenant-a"]]
    assert len(salted_events) == 1  # the salted prompt's first chunk names the salt
    assert salted_events[0]["extra_keys"][1] is None  # in its first block only, as vLLM's
    # The adapter's five chunks name it, in the fields and in every block's extra keys, as
    # vLLM's GPU events do; the others name none.
    lora = [e for e in stored if e["lora_id"] is not None]
    assert [(e["lora_id"], e["lora_name"], e["extra_keys"]) for e in lora] == [
        (7, "a", [["a"], ["a"]])
    ] * 5
    assert sum(e["lora_name"] is None for e in stored) == 10
    # reset_connector drops the CPU tier: the same hashes are removed, none other (and the
    # pass, computed again, stores the same 15 chunks again).
    removed = cpu_events(result["passes"][1]["events"], "BlockRemoved")
    assert hashes_of(removed) == hashes_of(stored)
    again = cpu_events(result["passes"][1]["events"], "BlockStored")
    assert hashes_of(again) == hashes_of(stored)
    # An ordinary eviction: the chunks the fresh prompts push out, each announced once.
    last = result["passes"][2]
    evicted = cpu_events(last["events"], "BlockRemoved")
    assert delta_evictions(result) == len(evicted) == 9
    assert set(hashes_of(evicted)) <= set(hashes_of(again))
    assert len(cpu_events(last["events"], "BlockStored")) == 10


def delta_evictions(result: dict[str, Any]) -> int:
    figures = [p["stats"]["scheduler"]["index_evictions"] for p in result["passes"]]
    return int(figures[2] - figures[1])
