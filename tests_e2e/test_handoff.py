"""Prefill and decode on two engines running at once: the decode engine's request arrives
while the prefill engine's stores are still on their way to the shared tier.

What no other test proves: the hand-off does not race. The producer (``kv_producer``)
writes its lower tier slowly (the fault point ``store.slow_lower``, as a slow disk or a
far server would), so its outputs are out, and the consumer (``kv_consumer``) sends its
requests, seconds before the chunks land. The consumer's lookups find them marked as on
their way and ask vLLM to try again, then load them: vLLM's own counters show each
prompt served up to its last whole chunk, with the tokens and logprobs of vLLM's own
prefix cache. Llama and Gemma-4 over the disk tier and over Redis; a negative control
damages the Llama's loads. On Qwen3-Next the hit needs, besides the attention chunks,
the recurrent state of each gated-DeltaNet group at the prompt's last block boundary
(align mode): the producer marks and stores them with the chunks, and the consumer waits
for them and loads them from the tier. Over the disk tier only: Redis would add nothing
a Qwen3-Next case proves, since the marks and the wait are the scheduler's whatever the
tier (the other cases run them over Redis), and a state is a chunk like any other there.
The Llama's hand-off runs once more with each engine's kvoffload inside vLLM's
``MultiConnector``, beside the example connector. (The marks themselves, a failed store,
a lapsed wait, a recurrent hybrid's tail that is all a producer has on its way: the unit
suite, tests/test_handoff.py.)
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
    Reference,
    assert_same_output,
    connector_hit,
    negative_control,
    own_cache_alone_oracle,
    with_disk,
)
from test_multi_connector import EXAMPLE_HIT, INJECTED, example, example_stored
from test_recurrent import (
    QWEN_ENGINE,
    QWEN_PROMPTS,
    assert_like_the_oracle,
    block_size,
    state_files,
)

#: Long enough that the consumer looks up well before the chunks land, on a busy machine.
SLOW = "store.slow_lower=4s"


def shared_tier(tier: str, tmp_path: Path, request: pytest.FixtureRequest) -> dict[str, Any]:
    if tier == "disk":
        return with_disk(tmp_path / "kv", "64MiB")
    server = request.getfixturevalue("redis_server")
    return {"remote_url": server.url, "remote_timeout_ms": 5000}


#: model fixture, engine arguments, prompts, blocks_per_chunk. Each prompt's hit is its
#: last whole chunk of the largest span (the Llama's 64 tokens: [256, 320, 320]; Gemma-4's
#: 512: [1024]; Qwen3-Next's one block, 256 or 384 tokens by CPU: 1024 or 768). The
#: Gemma-4 prompts share every chunk of their hit (1024 tokens, a multiple of the largest
#: chunk, 512), which the first prompt's store job writes, so one prompt makes the race;
#: so does Qwen3-Next's, whose hit is one store job's too (align mode stops its prefill
#: at the hit, where vLLM keeps the states).
MODELS = {
    "llama": ("llama", LLAMA_ENGINE, LLAMA_PROMPTS, 2),
    "gemma4": ("gemma4", GEMMA_ENGINE, GEMMA_PROMPTS[:1], 1),
    "qwen3_next": ("qwen3_next", QWEN_ENGINE, QWEN_PROMPTS[:1], 1),
}
LLAMA_HITS = [connector_hit(p, 64) for p in LLAMA_PROMPTS]  # [256, 320, 320]


def oracle_of(
    engine: Engine, request: pytest.FixtureRequest, case: str, spec: dict[str, Any]
) -> dict[str, Any]:
    """vLLM's own cache serving each prompt sent alone (OA). For Qwen3-Next's one prompt
    that is RQ0's second pass (vLLM's cache serving the prompt computed alone before it):
    shared with test_in_step."""
    model, engine_args, prompts = spec["model"], spec["engine"], spec["prompts"]
    if case != "qwen3_next":
        return own_cache_alone_oracle(engine, model, engine_args, prompts)
    reference: Reference = request.getfixturevalue("reference")
    expected = reference(model, engine_args, prompts)
    return {**expected, "passes": expected["passes"][1:2]}


def hand_off(
    engine: Engine, tmp_path: Path, producer: dict[str, Any], consumer: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run a producer and a consumer (their specs, roles included) at once; their results.

    The producer prefills (one token, as a proxy asks) once the consumer is up, its stores
    held back (``SLOW``); the consumer sends its prompts, one at a time (``ALONE``), as
    soon as the producer's outputs are out. The producer marked its chunks, none failed.
    """
    ready, produced = tmp_path / "consumer-ready", tmp_path / "produced"
    producer = {**producer, "max_tokens": 1, "env": {"KVOFFLOAD_FAILPOINTS": SLOW},
                "passes": [{"wait_for": str(ready), "signal_end": str(produced)}]}  # fmt: skip
    consumer = {**consumer, "passes": [{**ALONE, "signal_start": str(ready),
                                        "wait_for": str(produced)}]}  # fmt: skip
    with ThreadPoolExecutor(2) as pool:
        made, served = pool.map(lambda s: engine(**s), [producer, consumer])
    assert made["error"] is None, made["error"]
    assert made["stats"]["scheduler"]["handoff_marked_chunks"] > 0  # stores report later
    assert made["stats"]["scheduler"]["handoff_mark_failures"] == 0
    return made, served


def assert_waited_and_loaded(consumer: dict[str, Any], hits: list[int]) -> None:
    """vLLM cached each prompt's hit (it computed only the rest), the consumer waited for
    the producer's marked chunks and loaded all of them, with no wait run out."""
    assert consumer["passes"][0]["cached"] == hits  # nothing recomputed but the tail
    waited = consumer["stats"]["scheduler"]
    assert waited["handoff_waited_requests"] > 0 and waited["handoff_waits"] > 0
    assert waited["handoff_timeouts"] == 0 and waited["failed_loads"] == 0
    assert waited["loaded_tokens"] == sum(hits)


@pytest.mark.parametrize(
    ("case", "tier"),
    [("llama", "disk"), ("llama", "redis"), ("gemma4", "disk"), ("gemma4", "redis"),
     ("qwen3_next", "disk")],
)  # fmt: skip
def test_a_request_sent_while_the_producer_stores_waits_and_loads(
    engine: Engine, tmp_path: Path, request: pytest.FixtureRequest, case: str, tier: str
) -> None:
    fixture, engine_args, prompts, blocks_per_chunk = MODELS[case]
    model: str = request.getfixturevalue(fixture)
    connector = {"blocks_per_chunk": blocks_per_chunk, "cpu_bytes_to_use": "64MiB"}
    connector |= shared_tier(tier, tmp_path, request)
    spec = {"model": model, "engine": engine_args, "prompts": prompts, "connector": connector}
    producer, consumer = hand_off(engine, tmp_path, {**spec, "kv_role": "kv_producer"},
                                  {**spec, "kv_role": "kv_consumer"})  # fmt: skip
    oracle = oracle_of(engine, request, case, spec)
    assert_same_output(consumer, oracle)
    chunk = max(consumer["kv_cache_groups"]) * blocks_per_chunk
    assert_waited_and_loaded(consumer, [connector_hit(p, chunk) for p in prompts])
    if case == "qwen3_next":
        assert_states_handed_off(producer, consumer, oracle, tmp_path / "kv")
    if case != "llama":
        return  # its window chunks and states load as in test_remote's gemma4 case and
        # test_recurrent's, which have the controls
    # The check sees a damaged load of the same hand-off (the chunks are there by now).
    late = {**spec, "kv_role": "kv_consumer", "passes": [ALONE]}
    negative_control(engine, lambda r: assert_same_output(r, oracle), "load.corrupt_block", **late)


ROLES = ("kv_producer", "kv_consumer")


def in_multiconnector(role: str, connector: dict[str, Any], storage: Path) -> dict[str, Any]:
    """A ``kv_transfer_config`` of vLLM's ``MultiConnector``: kvoffload first, in ``role``,
    then the example connector, its files under ``storage`` (one directory an engine)."""
    mine = {"kv_connector": "KVOffloadConnector", "kv_connector_module_path": "kvoffload.vllm",
            "kv_role": role, "kv_connector_extra_config": connector}  # fmt: skip
    other = {**example(storage), "kv_role": role}
    return {"kv_connector": "MultiConnector", "kv_role": role,
            "kv_connector_extra_config": {"connectors": [mine, other]}}  # fmt: skip


def test_the_hand_off_inside_multiconnector_beside_the_example_connector(
    engine: Engine, llama: str, tmp_path: Path
) -> None:
    """Each engine runs vLLM's ``MultiConnector`` of kvoffload, with its role in its own
    entry, and the example connector (each engine its own files, so only kvoffload can
    carry the prompts between them). What only this proves: kvoffload takes its role from
    its entry (the producer loads nothing, the consumer stores nothing), and the
    consumer's "ask again" passes through ``MultiConnector`` (which asks again while any
    child does), so the hand-off does not race there either: the Llama disk case's
    checks. Listed first, kvoffload serves every load; the example connector, which
    stored what its engine computed, loads nothing."""
    connector = with_disk(tmp_path / "kv", "64MiB", blocks_per_chunk=2, cpu_bytes_to_use="64MiB")
    spec = {"model": llama, "engine": LLAMA_ENGINE, "prompts": LLAMA_PROMPTS}
    pair = [{**spec, "kv_transfer_config": in_multiconnector(role, connector, tmp_path / role)}
            for role in ROLES]  # fmt: skip
    producer, consumer = hand_off(engine, tmp_path, *pair)
    assert_same_output(consumer, own_cache_alone_oracle(engine, llama, LLAMA_ENGINE, LLAMA_PROMPTS))
    assert_waited_and_loaded(consumer, LLAMA_HITS)
    made, waited = producer["stats"]["scheduler"], consumer["stats"]["scheduler"]
    assert made["lookups"] > 0 and made["hit_tokens"] == made["loaded_tokens"] == 0
    assert waited["stores"] == waited["stored_chunks"] == 0
    # Its loads came from the producer's disk tier: the first prompt's 4 chunks, and each
    # later prompt's fifth; their first four from its CPU tier, where the first's load put
    # them.
    by_tier = {"disk": 256 + 64 + 64, "cpu": 256 + 256}
    assert waited["hit_tokens_by_tier"] == waited["loaded_tokens_by_tier"] == by_tier
    made_log, served_log = (Path(r["log"]).read_text() for r in (producer, consumer))
    assert not INJECTED.findall(made_log + served_log)  # the example connector loaded nothing
    # Both stored: the producer's all three prompts; the consumer's the first and the third,
    # and had a hit for the second (it names that prompt's 288 tokens by the first's), which
    # kvoffload, listed first, served.
    assert example_stored(tmp_path / "kv_producer") == [2, 2, 2]
    assert example_stored(tmp_path / "kv_consumer") == [2, 2]
    assert served_log.count(EXAMPLE_HIT) == 1


def assert_states_handed_off(
    producer: dict[str, Any], consumer: dict[str, Any], oracle: dict[str, Any], disk: Path
) -> None:
    """Qwen3-Next: the consumer's hit is vLLM's own cache's (align mode: the prompt's last
    block boundary), and it took the state of each gated-DeltaNet group there from the
    disk tier, beside the attention chunks below it."""
    assert_like_the_oracle(consumer, oracle)  # cached too
    hit, states = consumer["passes"][0]["cached"][0], len(consumer["kv_cache_groups"]) - 1
    chunks = hit // block_size(consumer) + states  # the attention chunks, a state a group
    # The producer marked them all (its stores land after its result is read), and the
    # states are on the disk, one file each.
    assert producer["stats"]["scheduler"]["handoff_marked_chunks"] == chunks
    assert len(state_files(disk, consumer)) == states == 3
    waited, worker = consumer["stats"]["scheduler"], consumer["stats"]["worker"]
    assert waited["lower_hit_chunks"] == chunks and waited["cpu_hit_chunks"] == 0
    assert worker["load_chunks"] == worker["tiers"]["disk"]["loads"] == chunks
