"""KVOffloadConnector on a real vLLM engine: offloaded KV comes back right and saves prefill.

Each test generates greedily from prompts with shared prefixes, resets vLLM's
prefix cache, and generates again. After the reset only the connector can
serve the first prompt of the second pass (later prompts of one batch may hit
vLLM's own cache again), so its ``num_cached_tokens`` is the connector's hit:
0 without the connector, > 0 with it, and the tokens must not change.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _harness import Engine, shared_prefix_prompts

TWO_PASSES = [{}, {"reset": True}]

LLAMA_ENGINE = {"block_size": 32, "max_model_len": 1024}
LLAMA_PROMPTS = shared_prefix_prompts(3, prefix_len=300, suffix_len=20, vocab=512)

# vLLM's hybrid prefix cache hits only at multiples of the largest block (512 tokens
# with block_size=32), so the shared prefix is longer than two of them.
GEMMA_ENGINE = {"block_size": 32, "max_model_len": 4096}
GEMMA_PROMPTS = shared_prefix_prompts(3, prefix_len=1100, suffix_len=20, vocab=1024)

_baselines: dict[tuple[str, str], dict[str, Any]] = {}


def baseline(engine: Engine, model: str, engine_args: dict[str, Any], prompts: Any) -> Any:
    """The same passes without the connector (cached per model and prompts)."""
    key = (model, repr(prompts))
    if key not in _baselines:
        result = engine(model=model, engine=engine_args, prompts=prompts, passes=TWO_PASSES)
        assert result["error"] is None, result["error"]
        first, second = result["passes"]
        # Without the connector the reset leaves nothing to hit for the first prompt.
        assert second["cached"][0] == 0, second["cached"]
        assert first["tokens"] == second["tokens"]
        _baselines[key] = result
    return _baselines[key]


def assert_served_by_connector(result: dict[str, Any], reference: dict[str, Any]) -> None:
    """Same tokens as the run without the connector; the connector served the first prompt."""
    assert result["error"] is None, result["error"]
    first, second = result["passes"]
    assert first["tokens"] == reference["passes"][0]["tokens"]
    assert second["tokens"] == first["tokens"]
    assert second["cached"][0] > 0, second["cached"]
    scheduler = result["figures"]["scheduler"]
    assert scheduler["loaded_tokens"] >= second["cached"][0]
    assert scheduler["failed_loads"] == 0
    assert scheduler["loaded_tokens"] == scheduler["hit_tokens"]
    worker = result["figures"]["worker"]
    assert worker["load_chunks"] > 0
    assert worker.get("failed_load_chunks", 0) == 0


@pytest.mark.parametrize("blocks_per_chunk", [1, 4])
def test_llama_round_trip(engine: Engine, llama: str, blocks_per_chunk: int) -> None:
    reference = baseline(engine, llama, LLAMA_ENGINE, LLAMA_PROMPTS)
    result = engine(
        model=llama,
        engine=LLAMA_ENGINE,
        prompts=LLAMA_PROMPTS,
        passes=TWO_PASSES,
        connector={"blocks_per_chunk": blocks_per_chunk, "cpu_bytes_to_use": "64MiB"},
    )
    assert_served_by_connector(result, reference)
    # A hit is whole chunks, and one token is always left to compute.
    chunk_tokens = 32 * blocks_per_chunk
    hit = result["passes"][1]["cached"][0]
    assert hit % chunk_tokens == 0
    assert hit == (len(LLAMA_PROMPTS[0]) - 1) // chunk_tokens * chunk_tokens


@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_gemma4_hybrid_round_trip(engine: Engine, gemma4: str, blocks_per_chunk: int) -> None:
    reference = baseline(engine, gemma4, GEMMA_ENGINE, GEMMA_PROMPTS)
    result = engine(
        model=gemma4,
        engine=GEMMA_ENGINE,
        prompts=GEMMA_PROMPTS,
        passes=TWO_PASSES,
        connector={"blocks_per_chunk": blocks_per_chunk, "cpu_bytes_to_use": "256MiB"},
    )
    assert_served_by_connector(result, reference)
    # Four groups; the sliding-window ones need only the chunk(s) of the window.
    assert result["passes"][1]["cached"][0] % 512 == 0


def test_gemma4_block_size_is_refused_at_start(engine: Engine, gemma4: str) -> None:
    result = engine(
        model=gemma4,
        engine=GEMMA_ENGINE,
        prompts=GEMMA_PROMPTS[:1],
        connector={"block_size": 64, "cpu_bytes_to_use": "64MiB"},
    )
    assert result["error"] is not None
    assert "ConfigError" in result["error"]
    assert "use 'blocks_per_chunk' instead" in result["error"]
    assert "[512, 512, 512, 32]" in result["error"]


def test_small_cpu_tier_loads_from_disk(engine: Engine, llama: str, tmp_path: Path) -> None:
    # Four prompts of ten 16 KiB chunks each (40), scheduled in one step; the CPU tier
    # holds 24, so stores evict and the first prompt's chunks are gone from it by the
    # second pass. Its chunks must come back from disk.
    prompts = [shared_prefix_prompts(1, 320, 0, 512, seed=s)[0] for s in range(4)]
    reference = baseline(engine, llama, LLAMA_ENGINE, prompts)
    connector = {
        "blocks_per_chunk": 1,
        "cpu_bytes_to_use": 24 * 16384,
        "disk_path": str(tmp_path / "kv"),
        "disk_bytes_to_use": "64MiB",
    }
    result = engine(
        model=llama, engine=LLAMA_ENGINE, prompts=prompts, passes=TWO_PASSES, connector=connector
    )
    assert result["error"] is None, result["error"]
    assert result["passes"][0]["tokens"] == reference["passes"][0]["tokens"]
    assert result["passes"][1]["tokens"] == reference["passes"][0]["tokens"]
    assert result["passes"][1]["cached"][0] > 0
    scheduler, worker = result["figures"]["scheduler"], result["figures"]["worker"]
    assert scheduler["index_evictions"] > 0  # the working set did not fit
    assert scheduler["lower_hit_chunks"] > 0
    assert worker["traffic"]["disk"]["loads"] > 0
    assert scheduler["failed_loads"] == 0


def test_restart_loads_what_the_previous_process_stored(
    engine: Engine, llama: str, tmp_path: Path
) -> None:
    reference = baseline(engine, llama, LLAMA_ENGINE, LLAMA_PROMPTS)
    connector = {
        "blocks_per_chunk": 2,
        "cpu_bytes_to_use": "64MiB",
        "disk_path": str(tmp_path / "kv"),
        "disk_bytes_to_use": "64MiB",
    }
    first = engine(model=llama, engine=LLAMA_ENGINE, prompts=LLAMA_PROMPTS, connector=connector)
    assert first["error"] is None, first["error"]
    assert first["passes"][0]["cached"][0] == 0
    second = engine(model=llama, engine=LLAMA_ENGINE, prompts=LLAMA_PROMPTS, connector=connector)
    assert second["error"] is None, second["error"]
    assert second["passes"][0]["tokens"] == reference["passes"][0]["tokens"]
    assert second["passes"][0]["cached"][0] > 0  # a fresh process: only the disk has it
    scheduler = second["figures"]["scheduler"]
    assert scheduler["lower_hit_chunks"] > 0
    assert scheduler["loaded_tokens"] >= second["passes"][0]["cached"][0]


def _corrupt_chunk_files(directory: Path) -> int:
    """Overwrite bytes in the middle of every chunk's payload; return the files damaged."""
    files = sorted(directory.rglob("*.kv"))
    for path in files:
        with path.open("r+b") as f:
            f.seek(4096 + 100)  # past the 4 KiB header, inside the KV bytes
            f.write(b"\xa5" * 64)
    return len(files)


@pytest.mark.parametrize("model_name", ["llama", "gemma4"])
def test_corrupt_chunks_are_recomputed(
    engine: Engine, request: pytest.FixtureRequest, model_name: str, tmp_path: Path
) -> None:
    model = request.getfixturevalue(model_name)
    engine_args, prompts = (
        (LLAMA_ENGINE, LLAMA_PROMPTS) if model_name == "llama" else (GEMMA_ENGINE, GEMMA_PROMPTS)
    )
    reference = baseline(engine, model, engine_args, prompts)
    connector = {
        "blocks_per_chunk": 1,
        "cpu_bytes_to_use": "256MiB",
        "disk_path": str(tmp_path / "kv"),
        "disk_bytes_to_use": "256MiB",
    }
    stored = engine(model=model, engine=engine_args, prompts=prompts, connector=connector)
    assert stored["error"] is None, stored["error"]
    assert _corrupt_chunk_files(tmp_path / "kv") > 0
    result = engine(model=model, engine=engine_args, prompts=prompts, connector=connector)
    assert result["error"] is None, result["error"]
    assert result["passes"][0]["tokens"] == reference["passes"][0]["tokens"]
    scheduler, worker = result["figures"]["scheduler"], result["figures"]["worker"]
    assert scheduler["failed_loads"] > 0
    assert scheduler["loaded_tokens"] == 0
    assert worker["failed_load_blocks"] > 0
    assert worker["engine"]["tiers"]["disk"]["corrupt_chunks"] > 0
