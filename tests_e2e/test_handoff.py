"""Prefill and decode on two engines running at once: the decode engine's request arrives
while the prefill engine's stores are still on their way to the shared tier.

What no other test proves: the hand-off does not race. The producer (``kv_producer``)
writes its lower tier slowly (the fault point ``store.slow_lower``, as a slow disk or a
far server would), so its outputs are out, and the consumer (``kv_consumer``) sends its
requests, seconds before the chunks land. The consumer's lookups find them marked as on
their way and ask vLLM to try again, then load them: vLLM's own counters show each
prompt served up to its last whole chunk, with the tokens and logprobs of vLLM's own
prefix cache. Over the disk tier and over Redis; a negative control damages the loads.
(The marks themselves, a failed store, a lapsed wait: the unit suite, tests/test_handoff.py.)
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from _harness import (
    ALONE,
    GEMMA_ENGINE,
    GEMMA_PROMPTS,
    LLAMA_ENGINE,
    LLAMA_PROMPTS,
    Engine,
    assert_same_output,
    connector_hit,
    negative_control,
    own_cache_alone_oracle,
    with_disk,
)

#: Long enough that the consumer looks up well before the chunks land, on a busy machine.
SLOW = "store.slow_lower=4s"


def shared_tier(tier: str, tmp_path: Path, request: pytest.FixtureRequest) -> dict[str, Any]:
    if tier == "disk":
        return with_disk(tmp_path / "kv", "64MiB")
    server = request.getfixturevalue("redis_server")
    return {"remote_url": server.url, "remote_timeout_ms": 5000}


LLAMA_HITS = [connector_hit(p, 64) for p in LLAMA_PROMPTS]
#: model fixture, engine arguments, prompts, blocks_per_chunk, each prompt's hit. The
#: Gemma-4 prompts share every chunk of their hit (1024 tokens, a multiple of the largest
#: chunk, 512), which the first prompt's store job writes, so one prompt makes the race.
MODELS = {
    "llama": ("llama", LLAMA_ENGINE, LLAMA_PROMPTS, 2, LLAMA_HITS),
    "gemma4": ("gemma4", GEMMA_ENGINE, GEMMA_PROMPTS[:1], 1, [1024]),
}


@pytest.mark.parametrize(
    ("case", "tier"),
    [("llama", "disk"), ("llama", "redis"), ("gemma4", "disk"), ("gemma4", "redis")],
)
def test_a_request_sent_while_the_producer_stores_waits_and_loads(
    engine: Engine, tmp_path: Path, request: pytest.FixtureRequest, case: str, tier: str
) -> None:
    fixture, engine_args, prompts, blocks_per_chunk, hits = MODELS[case]
    model: str = request.getfixturevalue(fixture)
    connector = {"blocks_per_chunk": blocks_per_chunk, "cpu_bytes_to_use": "64MiB"}
    connector |= shared_tier(tier, tmp_path, request)
    spec = {"model": model, "engine": engine_args, "prompts": prompts, "connector": connector}
    ready, produced = tmp_path / "consumer-ready", tmp_path / "produced"
    # The producer prefills (one token, as a proxy asks) once the consumer is up; the
    # consumer sends its prompts, one at a time, as soon as the producer's outputs are out.
    producer_spec = {**spec, "kv_role": "kv_producer", "max_tokens": 1,
                     "env": {"KVOFFLOAD_FAILPOINTS": SLOW},
                     "passes": [{"wait_for": str(ready), "signal_end": str(produced)}]}  # fmt: skip
    consumer_spec = {**spec, "kv_role": "kv_consumer",
                     "passes": [{**ALONE, "signal_start": str(ready),
                                 "wait_for": str(produced)}]}  # fmt: skip
    with ThreadPoolExecutor(2) as pool:
        producer, consumer = pool.map(lambda s: engine(**s), [producer_spec, consumer_spec])
    assert producer["error"] is None, producer["error"]
    made = producer["stats"]["scheduler"]
    assert made["handoff_marked_chunks"] > 0  # its stores report after its outputs
    assert made["handoff_mark_failures"] == 0

    oracle = own_cache_alone_oracle(engine, model, engine_args, prompts)
    assert_same_output(consumer, oracle)
    assert consumer["passes"][0]["cached"] == hits  # nothing recomputed but the tail
    waited = consumer["stats"]["scheduler"]
    assert waited["handoff_waited_requests"] > 0 and waited["handoff_waits"] > 0
    assert waited["handoff_timeouts"] == 0 and waited["failed_loads"] == 0
    assert waited["loaded_tokens"] == sum(hits)
    if case != "llama":
        return  # its window chunks load as in test_remote's gemma4 case, which has the control
    # The check sees a damaged load of the same hand-off (the chunks are there by now).
    late = {**spec, "kv_role": "kv_consumer", "passes": [ALONE]}
    negative_control(engine, lambda r: assert_same_output(r, oracle), "load.corrupt_block", **late)
