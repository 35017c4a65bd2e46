"""Prefill and decode on different engines over a shared disk tier: vLLM's ``kv_role``.

What no other test proves: the role vLLM is started with reaches the connector. A
``kv_producer`` stores and never loads, even what its own CPU tier holds; a
``kv_consumer`` started after it loads what it stored, with vLLM's own cache's
tokens and logprobs, and stores nothing. (Which requests each role plans what for
is proven in the unit suite, ``tests/test_roles.py``; a consumer looking up while a
producer still stores, in ``test_handoff.py``.) A consumer that would name chunks
otherwise than the producer is warned at start, naming the setting.
"""

from __future__ import annotations

from pathlib import Path

from _harness import (
    ALONE,
    LLAMA_ENGINE,
    LLAMA_PROMPTS,
    Engine,
    Reference,
    assert_same_output,
    assert_same_tokens,
    connector_hit,
    own_cache_alone_oracle,
    with_disk,
)


def kv_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.rglob("*.kv"))


def test_a_consumer_loads_what_a_producer_stored_and_stores_nothing(
    engine: Engine, reference: Reference, llama: str, tmp_path: Path
) -> None:
    connector = with_disk(tmp_path / "kv", "64MiB", blocks_per_chunk=2, cpu_bytes_to_use="64MiB")
    spec = {"model": llama, "engine": LLAMA_ENGINE, "prompts": LLAMA_PROMPTS}
    spec["connector"] = connector
    # The producer's second pass follows a reset of vLLM's cache: its CPU tier holds every
    # chunk, and it loads none; only vLLM's own cache serves.
    producer = engine(**spec, kv_role="kv_producer", passes=[{}, {"reset": True}])
    expected = reference(llama, LLAMA_ENGINE, LLAMA_PROMPTS)
    assert_same_tokens(producer, expected)
    scheduler = producer["stats"]["scheduler"]
    assert scheduler["stored_chunks"] > 0
    assert scheduler["hit_tokens"] == scheduler["loaded_tokens"] == 0
    # What vLLM's own cache gives after a reset (the first prompt's blocks, to the others).
    assert producer["passes"][1]["cached"] == expected["passes"][2]["cached"] == [0, 288, 288]
    assert (
        "kvoffload: kv_role kv_producer: never loads, stores" in Path(producer["log"]).read_text()
    )
    stored = kv_files(tmp_path / "kv")
    assert stored

    # The consumer: a new process, one prompt at a time (disk hits load over later steps).
    consumer = engine(**spec, kv_role="kv_consumer", passes=[ALONE])
    assert_same_output(consumer, own_cache_alone_oracle(engine, llama, LLAMA_ENGINE, LLAMA_PROMPTS))
    assert consumer["passes"][0]["cached"] == [connector_hit(p, 64) for p in LLAMA_PROMPTS]
    scheduler = consumer["stats"]["scheduler"]
    assert scheduler["loaded_tokens"] == sum(consumer["passes"][0]["cached"])
    assert scheduler["lower_hit_chunks"] > 0 and scheduler["failed_loads"] == 0
    assert scheduler["stored_chunks"] == 0
    assert kv_files(tmp_path / "kv") == stored

    # A consumer that names chunks otherwise (another blocks_per_chunk) is told so at start,
    # by the setting, and indeed finds nothing of what the producer stored.
    odd = {**spec, "connector": {**connector, "blocks_per_chunk": 1}, "prompts": LLAMA_PROMPTS[:1]}
    stranger = engine(**odd, kv_role="kv_consumer", max_tokens=1)
    log = Path(stranger["log"]).read_text()
    assert "kvoffload: this kv_consumer names chunks unlike every kv_producer that left" in log
    assert "has [64] tokens per chunk where this engine has [32] (kvoffload's blocks_per" in log
    assert stranger["stats"]["scheduler"]["hit_tokens"] == 0
