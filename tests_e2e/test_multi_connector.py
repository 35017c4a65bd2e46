"""kvoffload as one connector of vLLM's ``MultiConnector``, beside vLLM's ``ExampleConnector``.

What no other test proves: kvoffload inside ``MultiConnector`` beside a connector that also
holds every prompt's KV. ``ExampleConnector`` is vLLM's shared-storage transfer connector,
the one that runs on the CPU build. ``MultiConnector`` asks every child for each request. The
first child in its list with a hit loads, and every child stores. Here the two connectors
hold the same prompts. Listed first, kvoffload serves every load, and the example connector
loads nothing. Listed second, it offers the same hits, vLLM takes the other's, and kvoffload
loads nothing, fails nothing and keeps no pin. With its CPU tier emptied, it misses, the
other loads, and kvoffload stores none of what that loaded. In both orders both store, the
output is vLLM's own prefix cache's (tokens and logprobs), and vLLM's Prometheus figures
agree with kvoffload's. Both engines log stats, as ``vllm serve`` does. Before kvoffload
entered its name in vLLM's connector registry, this stopped the engine at its first logged
step: ``MultiConnector`` rebuilds a child's stats by the child's class name.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from _harness import (
    ALONE,
    LLAMA_ENGINE,
    LLAMA_PROMPTS,
    Engine,
    assert_passes_match,
    connector_hit,
    delta,
    differences,
    own_cache_one_by_one,
)

#: kvoffload's entry in ``MultiConnector``'s list, as a user writes it.
KVOFFLOAD = {
    "kv_connector": "KVOffloadConnector",
    "kv_connector_module_path": "kvoffload.vllm",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {"blocks_per_chunk": 1, "cpu_bytes_to_use": "64MiB"},
}
#: vLLM logs this line when the example connector loads a request (once per request).
INJECTED = re.compile(r"Inject KV cache of (\d+) tokens")
#: ...and this one when it has a hit for a request (once per lookup).
EXAMPLE_HIT = "External Cache Hit!"
#: vLLM's Llama logs stats (Prometheus figures, and the path that rebuilds connector stats).
ENGINE = {**LLAMA_ENGINE, "disable_log_stats": False}
#: The second pass: vLLM's own cache reset before each prompt, so every hit is a connector's.
LOADS = {"reset": True, **ALONE}


def run_multi(engine: Engine, llama: str, connectors: list[dict[str, Any]], **spec: Any) -> Any:
    kv_transfer_config = {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"connectors": connectors},
    }
    result = engine(model=llama, engine=ENGINE, prompts=LLAMA_PROMPTS,
                    kv_transfer_config=kv_transfer_config, **spec)  # fmt: skip
    assert result["error"] is None, result["error"]
    return result


def example(storage: Path) -> dict[str, Any]:
    """The example connector's entry: its KV files under ``storage``."""
    storage.mkdir()
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(storage)},
    }


def example_stored(storage: Path) -> list[int]:
    """Per prompt it stored (a folder each), its files: one a layer, so [2, 2, 2] here."""
    return sorted(len(list(folder.iterdir())) for folder in storage.iterdir())


def assert_kvoffload_clean(result: dict[str, Any]) -> None:
    """Nothing failed, nothing is left pinned or in flight, and it stored the cold pass."""
    scheduler, worker = result["stats"]["scheduler"], result["stats"]["worker"]
    assert scheduler["failed_loads"] == scheduler["failed_load_tokens"] == 0
    assert worker["failed_load_chunks"] == worker["failed_load_blocks"] == 0
    assert scheduler["index_pinned"] == scheduler["jobs_in_flight"] == 0
    assert scheduler["requests_tracked"] == 0
    # The cold pass stored 12 chunks: 9 of the shared prefix and each prompt's tenth; the
    # second (its prompts all held) none.
    assert delta(result, 0, "scheduler", "stored_chunks") == 12
    assert delta(result, 1, "scheduler", "stored_chunks") == 0
    assert "Recovered from KV load failure" not in Path(result["log"]).read_text()


def test_kvoffload_first_serves_every_load_while_the_other_holds_them_too(
    engine: Engine, llama: str, tmp_path: Path
) -> None:
    """The third pass empties kvoffload's CPU tier (``reset_connector``, forwarded by
    ``MultiConnector``) and sends the third prompt: the example connector, listed second,
    loads it, and kvoffload stores none of the blocks it loaded."""
    storage = tmp_path / "example"
    third = LLAMA_PROMPTS[2]
    passes = [{}, LOADS, {"reset_connector": True, "prompts": [third]}]
    result = run_multi(engine, llama, [KVOFFLOAD, example(storage)], passes=passes)
    oracle = own_cache_one_by_one(engine, llama, LLAMA_ENGINE, LLAMA_PROMPTS)
    assert_passes_match({**result, "passes": result["passes"][:2]}, oracle)
    cached = result["passes"][1]["cached"]
    assert cached == oracle["passes"][1]["cached"] == [connector_hit(p, 32) for p in LLAMA_PROMPTS]
    # kvoffload loaded every cached token of the second pass...
    for name in ("hit_tokens", "in_step_hit_tokens", "loaded_tokens"):
        assert delta(result, 1, "scheduler", name) == sum(cached) == 928, name
    assert delta(result, 1, "scheduler", "loads") == 3
    assert_kvoffload_clean(result)
    # ...though the example connector had a hit for every prompt of it; it loaded none.
    log = Path(result["log"]).read_text()
    assert log.count(EXAMPLE_HIT) == 3 + 1
    assert example_stored(storage) == [2, 2, 2]  # both stored
    # The third pass: kvoffload, empty, misses; the example connector loads the prompt.
    emptied = result["passes"][2]
    assert not differences(emptied, {k: oracle["passes"][1][k][2:] for k in ("tokens", "logprobs")})
    assert emptied["cached"] == [connector_hit(third, 32)] == [320]
    assert INJECTED.findall(log) == ["320"]
    assert delta(result, 2, "scheduler", "resets") == 1
    assert delta(result, 2, "scheduler", "loaded_tokens") == 0
    # It stores what vLLM computes, not the blocks another connector loaded: it cannot
    # tell whether that load succeeded. The two tokens computed fill no chunk.
    assert delta(result, 2, "scheduler", "stored_chunks") == 0
    assert result["stats"]["scheduler"]["index_used"] == 0
    metrics = result["metrics"]
    assert metrics["vllm:external_prefix_cache_hits"] == 928 + 320
    assert metrics["vllm:kvoffload_loaded_tokens"] == 928
    assert metrics["vllm:kvoffload_failed_loads"] == 0


def test_listed_second_kvoffload_offers_its_hits_and_loads_nothing_when_the_other_serves(
    engine: Engine, llama: str, tmp_path: Path
) -> None:
    """The second pass sends the prompts the example connector loads whole: the first and the
    third (it names the second prompt's 288 tokens by the first's, and vLLM would compute
    33 tokens of it, where vLLM's own cache computes one)."""
    storage = tmp_path / "example"
    served = [LLAMA_PROMPTS[0], LLAMA_PROMPTS[2]]
    passes = [{}, {**LOADS, "prompts": served}]
    result = run_multi(engine, llama, [example(storage), KVOFFLOAD], passes=passes)
    oracle = own_cache_one_by_one(engine, llama, LLAMA_ENGINE, LLAMA_PROMPTS)
    cold, loads = result["passes"]
    assert not differences(cold, oracle["passes"][0])
    want = {key: [oracle["passes"][1][key][i] for i in (0, 2)] for key in ("tokens", "logprobs")}
    assert not differences(loads, want)
    assert loads["cached"] == [connector_hit(p, 32) for p in served] == [288, 320]
    # The example connector loaded both prompts whole...
    log = Path(result["log"]).read_text()
    assert INJECTED.findall(log) == ["288", "320"]
    # ...and kvoffload, asked for both, found its whole prefix (no lookup missed), and
    # loaded nothing: vLLM took the first connector's hit.
    assert delta(result, 1, "scheduler", "lookups") == 2
    before, after = (p["stats"]["scheduler"]["miss_lookups_by_reason"] for p in (cold, loads))
    assert before == after
    for name in ("hit_requests", "hit_tokens", "loaded_tokens", "loads", "cpu_hit_chunks"):
        assert delta(result, 1, "scheduler", name) == 0, name
    assert delta(result, 1, "worker", "load_jobs") == 0
    assert_kvoffload_clean(result)
    assert example_stored(storage) == [2, 2, 2]
    metrics = result["metrics"]
    assert metrics["vllm:external_prefix_cache_hits"] == 608  # all the example connector's
    assert metrics.get("vllm:kvoffload_loaded_tokens", 0) == 0
    assert metrics["vllm:kvoffload_failed_loads"] == 0
