"""The connector's KV events, as a router receives them from vLLM's ZMQ publisher.

A router has already indexed the GPU's ``BlockStored`` events; the CPU
tier's must name the same blocks: vLLM's block hashes (64-bit ints), the
same token ids per block, the engine's block size, a parent the router has
seen, the salt and adapter in ``extra_keys`` / ``lora_name``, and a
``BlockRemoved`` with the same hashes when the CPU tier drops the chunk.
"""

from __future__ import annotations

from typing import Any

from _harness import LLAMA_ENGINE, LLAMA_PROMPTS, Engine

BLOCK = 32


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


def test_cpu_chunks_are_announced_as_the_gpu_blocks_they_copy(engine: Engine, llama: str) -> None:
    salted = {"prompt_token_ids": LLAMA_PROMPTS[1], "cache_salt": "tenant-a"}
    prompts = [LLAMA_PROMPTS[0], salted]
    result = engine(
        model=llama,
        engine=LLAMA_ENGINE,
        prompts=prompts,
        passes=[{}, {"reset_connector": True}, {}],
        connector={"blocks_per_chunk": 2, "cpu_bytes_to_use": "64MiB"},
        kv_events=True,
    )
    assert result["error"] is None, result["error"]
    first = result["passes"][0]["events"]
    gpu = gpu_blocks(first)
    stored = cpu_events(first, "BlockStored")
    assert gpu and stored
    chunks = result["passes"][0]["figures"]["scheduler"]["stored_chunks"]
    assert len(stored) == chunks  # one event per chunk, every chunk
    for event in stored:
        hashes = event["block_hashes"]
        assert event["block_size"] == BLOCK and len(hashes) == 2
        assert all(isinstance(h, int) for h in hashes)
        tokens = event["token_ids"]
        assert [tokens[:BLOCK], tokens[BLOCK:]] == [gpu[h] for h in hashes]  # same identity
        parent = event["parent_block_hash"]
        assert parent is None or parent in gpu  # a parent the router has seen
        assert event["group_idx"] == 0 and event["kv_cache_spec_kind"] == "full_attention"
    salted_events = [e for e in stored if e["extra_keys"] and e["extra_keys"][0]]
    assert len(salted_events) == 1  # the salted prompt's first chunk names the salt
    assert salted_events[0]["extra_keys"][0] == ["tenant-a"]
    # reset_connector drops the CPU tier: the same hashes are removed, none other.
    removed = cpu_events(result["passes"][1]["events"], "BlockRemoved")
    assert sorted(h for e in removed for h in e["block_hashes"]) == sorted(
        h for e in stored for h in e["block_hashes"]
    )
