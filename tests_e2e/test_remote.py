"""Two vLLM engines, in separate processes, share one Redis server (the remote tier).

The first engine computes and stores; it has no disk tier, so what survives
it is what it wrote to the server. The second engine starts empty (its own
CPU tier, vLLM's cache cold) and must serve its first pass from the server:
``num_cached_tokens`` of every prompt is the connector's hit, the tokens are
those of vLLM's own cache on the same prompts (one at a time), and its figures
show remote loads.
"""

from __future__ import annotations

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
    assert_loaded_tokens_match,
    assert_same_output,
    connector_hit,
    negative_control,
    own_cache_alone_oracle,
    run_storing_engine,
)
from _redis_servers import RedisServer

LLAMA_HITS = [connector_hit(p, 64) for p in LLAMA_PROMPTS]  # blocks_per_chunk 2 of 32 tokens
CASES = {
    # model fixture, engine arguments, prompts, blocks_per_chunk, hit of each prompt
    "llama": ("llama", LLAMA_ENGINE, LLAMA_PROMPTS, 2, LLAMA_HITS),
    # The hybrid model's hits end on multiples of its largest chunk (512 tokens).
    "gemma4": ("gemma4", GEMMA_ENGINE, GEMMA_PROMPTS, 1, [1024] * len(GEMMA_PROMPTS)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_second_engine_loads_what_the_first_stored_on_the_server(
    engine: Engine,
    reference: Reference,
    redis_server: RedisServer,
    request: pytest.FixtureRequest,
    case: str,
) -> None:
    model_name, engine_args, prompts, blocks_per_chunk, hits = CASES[case]
    model: str = request.getfixturevalue(model_name)
    expected = reference(model, engine_args, prompts)
    connector: dict[str, Any] = {
        "blocks_per_chunk": blocks_per_chunk,
        "cpu_bytes_to_use": "256MiB",
        "remote_url": redis_server.url,
        "remote_timeout_ms": 5000,  # two busy cores: no spurious outages
    }
    spec = {"model": model, "engine": engine_args, "prompts": prompts, "connector": connector}
    first = run_storing_engine(engine, expected, **spec)
    stored = first["stats"]["scheduler"]["stored_chunks"]
    on_server = redis_server.client().dbsize()
    # Every stored chunk reached the server before the first engine's process ended.
    assert on_server == stored, (on_server, stored)

    # Remote hits load over later steps: the prompts go one at a time (a batch's make-up
    # would be a timing), against vLLM's own cache serving each alone.
    spec["passes"] = [ALONE]
    expected = own_cache_alone_oracle(engine, model, engine_args, prompts)
    second = engine(**spec)
    assert_same_output(second, expected)
    assert second["passes"][0]["cached"] == hits
    assert_loaded_tokens_match(second, 0)
    scheduler, worker = second["stats"]["scheduler"], second["stats"]["worker"]
    assert scheduler["lower_hit_chunks"] > 0
    assert worker["tiers"]["redis"]["loads"] > 0
    assert worker["tiers"]["redis"]["misses"] == 0
    assert scheduler["failed_loads"] == 0
    assert worker.get("failed_load_chunks", 0) == 0
    if case == "llama":  # the negative control: a third engine, a damaged block a prompt
        check = lambda r: assert_same_output(r, expected)  # noqa: E731
        negative_control(engine, check, "load.corrupt_block", **spec)
