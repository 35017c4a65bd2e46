"""KVOffloadConnector on a real vLLM engine: offloaded KV comes back right and saves prefill.

Each test generates greedily from prompts with shared prefixes, resets vLLM's
prefix cache, and generates again. After the reset only the connector can
serve the first prompt of the second pass, so its ``num_cached_tokens`` is
the connector's hit: 0 without the connector (the reference checks that),
> 0 with it, and the tokens must be those of the run without the connector.
When all prompts of a pass are looked up in one scheduler step, before any
of them runs, every cached token of the pass after the reset is a token the
connector loaded: ``loaded_tokens`` of the pass equals the sum of
``num_cached_tokens`` exactly. When the connector defers a lookup (a chunk it
is still bringing up from disk: ``deferred_lookups``), the request is looked
up again at a later step and vLLM's own cache may serve part of it by then,
so only bounds hold.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from _harness import (
    ALONE,
    GEMMA_ENGINE,
    GEMMA_GROUPS,
    GEMMA_PROMPTS,
    LLAMA_ENGINE,
    LLAMA_PROMPTS,
    TWO_PASSES,
    Engine,
    Reference,
    alone_oracle,
    assert_loaded_tokens_match,
    assert_passes_match,
    assert_same_output,
    assert_same_tokens,
    connector_hit,
    delta,
    llama_stored_on_disk,
    negative_control,
    own_cache_alone_oracle,
    random_prompts,
    run_storing_engine,
    with_disk,
)
from _models import LLAMA, kv_bytes_per_token

#: KV bytes of one 32-token block of the Llama (2 layers, 2 KV heads of 32): 16 KiB.
LLAMA_BLOCK_BYTES = 32 * kv_bytes_per_token(LLAMA)


def assert_served_by_connector(result: dict[str, Any], reference: dict[str, Any]) -> None:
    """Same outputs as without the connector; pass 1 stored, pass 2 loaded, nothing failed."""
    assert_same_output(result, reference)
    first, second = result["passes"]
    assert delta(result, 0, "scheduler", "loaded_tokens") == 0  # nothing stored yet
    assert first["stats"]["scheduler"]["stored_chunks"] > 0
    assert second["cached"][0] > 0, second["cached"]
    assert_loaded_tokens_match(result, 1)
    scheduler, worker = result["stats"]["scheduler"], result["stats"]["worker"]
    assert scheduler["hit_tokens"] == scheduler["loaded_tokens"]
    assert scheduler["failed_loads"] == 0
    assert scheduler["failed_load_tokens"] == 0
    assert worker["load_chunks"] > 0
    assert worker.get("failed_load_chunks", 0) == 0
    assert worker.get("failed_load_blocks", 0) == 0
    assert worker.get("load_errors", 0) == 0


@pytest.mark.parametrize(
    ("extra", "chunk_tokens", "fault"),
    [
        ({"blocks_per_chunk": 1}, 32, "load.corrupt_block"),
        ({"blocks_per_chunk": 4}, 128, "load.wrong_block"),
        ({"block_size": 64}, 64, None),
    ],
    ids=["blocks_per_chunk=1", "blocks_per_chunk=4", "block_size=64"],
)
def test_llama_round_trip(  # noqa: PLR0917 - pytest passes fixtures and parameters
    engine: Engine,
    reference: Reference,
    llama: str,
    extra: dict[str, Any],
    chunk_tokens: int,
    fault: str | None,
) -> None:
    """Served exactly; with a fault point that damages one loaded block a prompt, not."""
    expected = reference(llama, LLAMA_ENGINE, LLAMA_PROMPTS)
    spec = {"model": llama, "engine": LLAMA_ENGINE, "prompts": LLAMA_PROMPTS,
            "passes": TWO_PASSES, "connector": {**extra, "cpu_bytes_to_use": "64MiB"}}  # fmt: skip
    result = engine(**spec, memo=True)  # at blocks_per_chunk 1 test_in_step's run too
    assert_served_by_connector(result, expected)
    hits = result["passes"][1]["cached"]
    # The first prompt's hit is the connector's; the others, looked up in the same step,
    # may take its blocks from vLLM's own cache (a load in the step is cached at once,
    # with the blocks the step computes), down to vLLM's 32-token blocks.
    assert hits[0] == connector_hit(LLAMA_PROMPTS[0], chunk_tokens)
    for hit, prompt in zip(hits, LLAMA_PROMPTS, strict=True):
        assert connector_hit(prompt, chunk_tokens) <= hit <= connector_hit(prompt, 32), hits
    if fault is not None:  # the negative control (block_size=64 is the same path as bpc 2)
        negative_control(engine, lambda r: assert_same_output(r, expected), fault, **spec)


@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_gemma4_hybrid_round_trip(
    engine: Engine, reference: Reference, gemma4: str, blocks_per_chunk: int
) -> None:
    """Served exactly; with the last loaded block of each group damaged, not."""
    expected = reference(gemma4, GEMMA_ENGINE, GEMMA_PROMPTS)
    connector = {"blocks_per_chunk": blocks_per_chunk, "cpu_bytes_to_use": "256MiB"}
    spec = {"model": gemma4, "engine": GEMMA_ENGINE, "prompts": GEMMA_PROMPTS,
            "passes": TWO_PASSES, "connector": connector}  # fmt: skip
    result = engine(**spec)
    assert result["kv_cache_groups"] == GEMMA_GROUPS
    assert_served_by_connector(result, expected)
    # A hit must end on a chunk boundary of every group: multiples of 512 * blocks_per_chunk
    # (the sliding groups' chunks), 1024 of the 1120 tokens either way.
    assert result["passes"][1]["cached"][0] == 1024
    negative_control(
        engine, lambda r: assert_same_output(r, expected), "load.corrupt_block", **spec
    )


def test_gemma4_block_size_key_is_refused_at_start(engine: Engine, gemma4: str) -> None:
    """The older key means tokens per chunk, which a hybrid layout cannot have."""
    result = engine(
        model=gemma4,
        engine=GEMMA_ENGINE,
        prompts=GEMMA_PROMPTS[:1],
        connector={"block_size": 64, "cpu_bytes_to_use": "64MiB"},
    )
    assert result["error"] is not None, "the engine started"
    message = result["error"]
    assert "ConfigError" in message
    assert "'block_size'" in message
    assert "blocks_per_chunk" in message
    assert str(GEMMA_GROUPS) in message  # the groups' tokens_per_block, as vLLM built them


def test_reset_connector_forgets_the_offloaded_kv(
    engine: Engine, reference: Reference, llama: str
) -> None:
    """``reset_prefix_cache(reset_connector=True)`` empties the connector's cache too."""
    expected = reference(llama, LLAMA_ENGINE, LLAMA_PROMPTS)
    result = engine(
        model=llama,
        engine=LLAMA_ENGINE,
        prompts=LLAMA_PROMPTS,
        passes=[{}, {"reset_connector": True}],
        connector={"blocks_per_chunk": 1, "cpu_bytes_to_use": "64MiB"},
    )
    assert_same_tokens(result, expected)
    assert result["passes"][1]["cached"][0] == 0
    assert result["stats"]["scheduler"]["loaded_tokens"] == 0


def test_small_cpu_tier_loads_from_disk(
    engine: Engine, reference: Reference, llama: str, tmp_path: Path
) -> None:
    """The working set is three times the CPU tier: the first prompt's chunks come from disk.

    The prompts go one at a time: all four in one step would store 40 chunks through 12
    slots, and those waiting for a slot are stored only if the slots' stores (written
    through to disk) finish before the request does, which depends on the machine.
    """
    prompts = random_prompts(4, 320, 512, seed=1)  # 10 full blocks each, nothing shared
    expected = reference(llama, LLAMA_ENGINE, prompts)
    connector = with_disk(
        tmp_path / "kv", "64MiB", blocks_per_chunk=1, cpu_bytes_to_use=12 * LLAMA_BLOCK_BYTES
    )  # 12 chunks; the passes store 40
    one_by_one = [{"one_by_one": True}, {"reset": True, "one_by_one": True}]
    result = engine(
        model=llama, engine=LLAMA_ENGINE, prompts=prompts, passes=one_by_one, connector=connector
    )
    assert_same_tokens(result, expected)
    second = result["passes"][1]
    assert second["cached"][0] == connector_hit(prompts[0], 32)
    assert_loaded_tokens_match(result, 1)
    scheduler, worker = result["stats"]["scheduler"], result["stats"]["worker"]
    assert scheduler["index_evictions"] > 0  # the working set did not fit
    assert scheduler["lower_hit_chunks"] >= 9  # at least the first prompt's came from disk
    assert worker["tiers"]["disk"]["loads"] >= 9
    assert scheduler["failed_loads"] == 0
    assert worker.get("failed_load_chunks", 0) == 0


def test_restart_loads_what_the_previous_process_stored(
    engine: Engine, reference: Reference, llama: str, tmp_path: Path
) -> None:
    spec, _ = llama_stored_on_disk(engine, reference, llama, tmp_path / "kv", 2)
    assert list((tmp_path / "kv").rglob("*.kv")), "nothing was written to disk"
    # A fresh process: vLLM's cache and the CPU tier are empty, only the disk has the chunks.
    # A fresh interpreter too (not forked from the suite's server): keys that followed
    # anything of one interpreter's (its hash seed) would miss here. Disk hits load over
    # later steps, so the prompts go one at a time (a batch would be a timing).
    spec = {**spec, "passes": [ALONE]}
    expected = own_cache_alone_oracle(engine, llama, LLAMA_ENGINE, LLAMA_PROMPTS)
    second = engine(**spec, fresh=True)
    assert_same_output(second, expected)
    cached = second["passes"][0]["cached"]
    assert cached == [connector_hit(p, 64) for p in LLAMA_PROMPTS]
    scheduler, worker = second["stats"]["scheduler"], second["stats"]["worker"]
    assert scheduler["loaded_tokens"] == sum(cached)
    assert scheduler["lower_hit_chunks"] > 0
    assert worker["tiers"]["disk"]["loads"] > 0
    assert scheduler["failed_loads"] == 0
    # The negative control: a third process loads the same files, a block short each time.
    negative_control(
        engine, lambda r: assert_same_output(r, expected), "load.skip_last_chunk", **spec
    )


#: vLLM's scheduler, when a connector reports failed blocks (one KV cache group) and the
#: policy is "recompute": how many tokens it rescheduled for computing again.
VLLM_RECOVERED = re.compile(
    r"Recovered from KV load failure: \d+ request\(s\) rescheduled \((\d+) tokens affected\)"
)


def vllm_recovered_tokens(result: dict[str, Any]) -> int:
    """The tokens vLLM itself says it rescheduled after failed loads (from the engine's log)."""
    return sum(int(n) for n in VLLM_RECOVERED.findall(Path(result["log"]).read_text()))


def assert_recomputed_after_corruption(result: dict[str, Any], oracle: dict[str, Any]) -> None:
    """Right outputs (pass by pass ``oracle``'s), no crash; the connector saw the damage, and
    so did vLLM.

    The model and the check are sensitive enough to see one wrong block (the negative
    controls above), so the same outputs mean vLLM computed what failed. vLLM's own
    signals: with one KV cache group, the tokens its scheduler logs as rescheduled equal
    the connector's failed tokens; with several (failures reported per request), the
    prompt vLLM recomputed shows no cached token.
    """
    assert_passes_match(result, oracle)
    assert all(f == "length" for done in result["passes"] for f in done["finish"])
    scheduler, worker = result["stats"]["scheduler"], result["stats"]["worker"]
    assert scheduler["failed_loads"] > 0
    assert scheduler["failed_load_tokens"] > 0
    assert worker["failed_load_blocks"] > 0
    assert worker["tiers"]["disk"]["corrupt"] > 0
    if len(result["kv_cache_groups"]) == 1:
        assert vllm_recovered_tokens(result) == scheduler["failed_load_tokens"]
    else:  # vLLM's failed_recving path logs nothing: its recompute shows in what it counts
        assert vllm_recovered_tokens(result) == 0
    assert result["passes"][-1]["cached"][0] == 0, "vLLM counted the failed tokens as cached"


@pytest.mark.parametrize("model_name", ["llama", "gemma4"])
def test_corrupt_chunks_after_restart_are_recomputed(
    engine: Engine,
    reference: Reference,
    request: pytest.FixtureRequest,
    model_name: str,
    tmp_path: Path,
) -> None:
    model = request.getfixturevalue(model_name)
    engine_args, prompts = {
        "llama": (LLAMA_ENGINE, LLAMA_PROMPTS),
        "gemma4": (GEMMA_ENGINE, GEMMA_PROMPTS),
    }[model_name]
    expected = reference(model, engine_args, prompts)
    connector = with_disk(tmp_path / "kv", "256MiB", blocks_per_chunk=1, cpu_bytes_to_use="256MiB")
    run_storing_engine(
        engine, expected, model=model, engine=engine_args, prompts=prompts, connector=connector
    )
    # The second process damages every chunk file before its (only) pass, of the first
    # prompt alone: computed when its reads fail, a timing, it has no batch to differ by
    # (ALONE); vLLM logs its statistics, so it counts the tokens it computed itself.
    first = prompts[:1]
    result = engine(
        model=model,
        engine={**engine_args, "disable_log_stats": False},
        prompts=first,
        passes=[{"corrupt": str(tmp_path / "kv")}],
        connector=connector,
        failure_policy="recompute",
    )
    assert result["passes"][0]["acted"]["corrupted_files"] > 0
    assert_recomputed_after_corruption(result, alone_oracle(engine, model, engine_args, first))
    assert result["stats"]["scheduler"]["loaded_tokens"] == 0  # every file was damaged
    # vLLM computed the first prompt whole itself (a clean load leaves it one token).
    computed = result["metrics"]["vllm:request_prefill_kv_computed_tokens_sum"]
    assert computed >= len(prompts[0]), computed


@pytest.mark.parametrize("action", ["corrupt", "truncate"])
def test_failed_chunks_in_one_process_are_recomputed(
    engine: Engine, reference: Reference, llama: str, tmp_path: Path, action: str
) -> None:
    """The CPU tier is too small to keep the first prompt, so its disk copy is read: damaged
    (it fails its checksum) or cut short (it fails the size check). A deleted file would
    only be a miss: the lookup sees it gone."""
    prompts = random_prompts(4, 320, 512, seed=1)
    expected = reference(llama, LLAMA_ENGINE, prompts)
    connector = with_disk(
        tmp_path / "kv", "64MiB", blocks_per_chunk=1, cpu_bytes_to_use=12 * LLAMA_BLOCK_BYTES
    )
    result = engine(
        model=llama,
        engine=LLAMA_ENGINE,
        prompts=prompts,
        passes=[{}, {"reset": True, action: str(tmp_path / "kv"), **ALONE}],
        connector=connector,
        failure_policy="recompute",
    )
    acted = result["passes"][1]["acted"]
    assert acted[{"corrupt": "corrupted_files", "truncate": "truncated_files"}[action]] > 0
    alone = alone_oracle(engine, llama, LLAMA_ENGINE, prompts)
    oracle = {"passes": [expected["passes"][0], alone["passes"][0]]}
    assert_recomputed_after_corruption(result, oracle)
