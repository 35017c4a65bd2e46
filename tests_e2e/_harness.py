"""What the end-to-end tests share besides fixtures: the engine callable, prompts, scenarios."""

from __future__ import annotations

import json
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _runner import stat_delta

#: Runs one engine process on a spec (see ``_runner.py``) and returns its result.
Engine = Callable[..., dict[str, Any]]
#: The run without the connector of (model, engine arguments, prompts); see conftest.
Reference = Callable[[str, dict[str, Any], list[list[int]]], dict[str, Any]]


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` prompts of ``length`` random token ids sharing nothing."""
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(length)] for _ in range(n)]


def shared_prefix_prompts(
    n: int, prefix_len: int, suffix_len: int, vocab: int, seed: int = 0
) -> list[list[int]]:
    """``n`` prompts of random token ids sharing their first ``prefix_len`` tokens.

    Prompt ``i`` has ``suffix_len + i`` tokens of its own after the prefix.
    """
    rng = random.Random(seed)
    prefix = [rng.randrange(1, vocab) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(1, vocab) for _ in range(suffix_len + i)] for i in range(n)]


#: Two passes: the first stores, the second (after vLLM's prefix cache is reset) loads.
TWO_PASSES: list[dict[str, Any]] = [{}, {"reset": True}]

LLAMA_ENGINE: dict[str, Any] = {"block_size": 32, "max_model_len": 1024}
#: Three prompts (320, 321, 322 tokens) sharing a 300-token prefix: 9 full blocks in common.
LLAMA_PROMPTS = shared_prefix_prompts(3, prefix_len=300, suffix_len=20, vocab=512)

# vLLM's hybrid prefix cache hits only at multiples of the largest block (512 tokens
# with block_size=32), so the shared prefix is longer than two of them.
GEMMA_ENGINE: dict[str, Any] = {"block_size": 32, "max_model_len": 4096}
GEMMA_PROMPTS = shared_prefix_prompts(3, prefix_len=1100, suffix_len=20, vocab=1024)
#: vLLM's tokens per block of the four KV cache groups of GEMMA4 at block_size=32.
GEMMA_GROUPS = [512, 512, 512, 32]

#: vLLM's reference MLA backend, so that an MLA model runs alike on every CPU: with AMX vLLM
#: picks its AMX kernels, which take no float32 weights ("expect weight to be bfloat16, ...")
#: nor 16-token blocks ("No common block size for 16 (AMX_MLA: [MultipleOf(32)])").
CPU_MLA: dict[str, Any] = {"attention_config": {"backend": "CPU_MLA"}}
#: The same for an MTP drafter's MLA layers (vLLM picks a drafter's backend apart).
CPU_MLA_DRAFTER: dict[str, Any] = {"attention_backend": "CPU_MLA"}
#: A DeepSeek-style MLA model in float32 (a recompute's near-tied tokens hold in it).
MLA_FLOAT32_ENGINE: dict[str, Any] = {
    "block_size": 16,
    "max_model_len": 1024,
    "dtype": "float32",
    **CPU_MLA,
}


def own_cache_oracle(
    run: Engine, model: str, args: dict[str, Any], passes: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """vLLM alone with the same settings (a drafter's, say) on ``LLAMA_PROMPTS``, 32 tokens:
    its own prefix cache serves the second pass. Run once a session per settings."""
    result = run(model=model, engine=args, prompts=LLAMA_PROMPTS, passes=passes or [{}, {}],
                 max_tokens=32, memo=True)  # fmt: skip
    assert result["error"] is None, result["error"]
    assert result["passes"][1]["cached"][0] > 0
    return result


#: A pass that sends its prompts one at a time, vLLM's prefix cache reset before each. For a
#: pass whose prompts are recomputed when a lower tier's failed reads say (a timing): on CPUs
#: with AMX a prompt's logprobs follow what else is batched with it (the Llama: 0.004 apart
#: between alone and a batch of four), so such a pass computes each prompt alone, as
#: :func:`alone_oracle` does.
ALONE: dict[str, Any] = {"one_by_one": True, "reset_each": True}


def alone_oracle(
    run: Engine, model: str, engine_args: dict[str, Any], prompts: list[list[int]]
) -> dict[str, Any]:
    """vLLM without the connector computing each prompt alone from nothing (one ``ALONE``
    pass), once a session per model, settings and prompts."""
    result = run(model=model, engine=engine_args, prompts=prompts, passes=[ALONE], memo=True)
    assert result["error"] is None, result["error"]
    assert result["passes"][0]["cached"] == [0] * len(prompts)
    return result


def own_cache_one_by_one(
    run: Engine, model: str, engine_args: dict[str, Any], prompts: list[list[int]]
) -> dict[str, Any]:
    """vLLM alone, once a session per model, settings and prompts: a batched cold pass, then
    its own prefix cache serving each prompt sent alone."""
    passes = [{}, {"one_by_one": True}]
    result = run(model=model, engine=engine_args, prompts=prompts, passes=passes, memo=True)
    assert result["error"] is None, result["error"]
    assert all(n > 0 for n in result["passes"][1]["cached"]), result["passes"][1]["cached"]
    return result


def own_cache_alone_oracle(
    run: Engine, model: str, engine_args: dict[str, Any], prompts: list[list[int]]
) -> dict[str, Any]:
    """:func:`own_cache_one_by_one`'s second pass, as a one-pass result: to compare with an
    ``ALONE`` pass whose hits come from a lower tier.

    Such hits load over later steps, so what a batched pass computes together is a timing
    (and on CPUs with AMX, batching moves logprobs). The KV reused is computed by the
    batched cold pass first, as the storing run computed what the subject loads.
    """
    result = own_cache_one_by_one(run, model, engine_args, prompts)
    return {**result, "passes": result["passes"][1:]}


def delta(result: dict[str, Any], n: int, side: str, name: str) -> int:
    """How much figure ``name`` of ``side`` grew during pass ``n`` of ``result``."""
    return stat_delta(result["passes"], n, side, name)


def assert_loaded_tokens_match(result: dict[str, Any], n: int) -> None:
    """``loaded_tokens`` of pass ``n`` against the pass's ``num_cached_tokens``.

    When all prompts of a pass are looked up in one scheduler step, every cached
    token after the reset is one the connector loaded: the two are equal. A
    deferred lookup (a chunk still coming up from disk) is looked up again
    later, when vLLM's own cache may serve part of it: then only bounds hold.
    So with loads in the step that asks (``load_in_step``): vLLM caches such a
    load's blocks at once, with those the step computes after them, and a
    prompt looked up later in the same step takes what they share from vLLM's
    own cache.
    """
    cached = result["passes"][n]["cached"]
    loaded = delta(result, n, "scheduler", "loaded_tokens")
    in_step = delta(result, n, "scheduler", "in_step_hit_tokens")
    if not in_step and delta(result, n, "scheduler", "deferred_lookups") == 0:
        assert loaded == sum(cached), (loaded, cached)
    else:
        assert 0 < loaded <= sum(cached), (loaded, cached)


def connector_hit(prompt: list[int], chunk_tokens: int) -> int:
    """The connector's hit on a prompt it holds whole: full chunks, one token left to compute."""
    return (len(prompt) - 1) // chunk_tokens * chunk_tokens


def assert_same_tokens(result: dict[str, Any], reference: dict[str, Any]) -> None:
    assert result["error"] is None, result["error"]
    expected = reference["passes"][0]["tokens"]
    for n, done in enumerate(result["passes"]):
        assert done["tokens"] == expected, f"pass {n} generated other tokens"
        assert all(f == "length" for f in done["finish"]), done["finish"]


#: How far a generated token's logprob may be from the reference's. Clean runs give the
#: reference's logprobs bit for bit here (vLLM's CPU kernels compute a row alike whatever
#: else is batched); the bound only absorbs float noise. One damaged block of the tiny
#: Llama moved them by 0.007 to 0.13 (tests_e2e/test_connector.py's negative control).
LOGPROB_TOL = 1e-4


def differences(done: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """How one pass's outputs differ from ``want``'s: tokens, or logprobs past the bound."""
    out = []
    pairs = zip(done["tokens"], want["tokens"], done["logprobs"], want["logprobs"], strict=True)
    for i, (tokens, want_tokens, logprobs, want_logprobs) in enumerate(pairs):
        if tokens != want_tokens:
            moved = sum(a != b for a, b in zip(tokens, want_tokens, strict=True))
            out.append(f"prompt {i}: {moved} of {len(tokens)} tokens differ")
            continue
        gap = max(abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True))
        if gap > LOGPROB_TOL:
            out.append(f"prompt {i}: same tokens, logprobs up to {gap:.4f} apart")
    return out


def assert_same_output(result: dict[str, Any], reference: dict[str, Any]) -> None:
    """:func:`assert_same_tokens`, and each generated token's logprob within ``LOGPROB_TOL``.

    A damaged block may leave a tiny model's greedy tokens alone; its logprobs move.
    """
    assert result["error"] is None, result["error"]
    for n, done in enumerate(result["passes"]):
        found = differences(done, reference["passes"][0])
        assert not found, f"pass {n}: " + "; ".join(found)
        assert all(f == "length" for f in done["finish"]), done["finish"]


def assert_passes_match(result: dict[str, Any], expected: dict[str, Any]) -> None:
    """Pass ``n`` has the tokens and logprobs of ``expected``'s pass ``n`` (an oracle that
    runs the same passes: vLLM's own prefix cache with the same settings)."""
    assert result["error"] is None, result["error"]
    for n, (done, want) in enumerate(zip(result["passes"], expected["passes"], strict=True)):
        found = differences(done, want)
        assert not found, f"pass {n}: " + "; ".join(found)


def failpoint_fired(result: dict[str, Any], point: str) -> int:
    """How often fault point ``point`` fired in the run's worker (0: not turned on)."""
    return int(result["stats"]["worker"].get(f"failpoint_{point.replace('.', '_')}", 0))


def negative_control(
    run: Engine, check: Callable[[dict[str, Any]], None], fault: str, /, **spec: Any
) -> str:
    """The run of ``spec`` with fault point ``fault`` on must fail ``check``; returns the verdict.

    The fault must have fired and stayed silent (no load reported failed), so it is the
    check, not the connector's own reporting, that sees the damage.
    """
    result = run(**spec, env={"KVOFFLOAD_FAILPOINTS": fault})
    assert result["error"] is None, result["error"]
    assert failpoint_fired(result, fault.split("=", 1)[0]) > 0, f"{fault} never fired"
    assert result["stats"]["scheduler"]["failed_loads"] == 0
    assert result["stats"]["worker"].get("failed_load_chunks", 0) == 0
    try:
        check(result)
    except AssertionError as failed:
        verdict = str(failed).splitlines()[0]
        print(f"\nnegative control, {fault}: the check failed as it must: {verdict}")
        return verdict
    raise AssertionError(f"the check passed with {fault} on: it cannot see a damaged block")


def assert_cold_store(first: dict[str, Any], expected: dict[str, Any]) -> None:
    """The first of two engine processes: right tokens, a cold start, chunks stored."""
    assert_same_tokens(first, expected)
    assert first["passes"][0]["cached"][0] == 0
    assert first["stats"]["scheduler"]["stored_chunks"] > 0


def run_storing_engine(run: Engine, expected: dict[str, Any], /, **spec: Any) -> dict[str, Any]:
    first = run(**spec)
    assert_cold_store(first, expected)
    return first


def with_disk(path: Path, disk_bytes: str, **connector: Any) -> dict[str, Any]:
    """Connector settings with a disk tier under ``path``."""
    return {**connector, "disk_path": str(path), "disk_bytes_to_use": disk_bytes}


#: Disk tiers an engine process filled, kept pristine, by what stored them (see stored_on_disk).
_STORED: dict[str, tuple[Path, dict[str, Any]]] = {}


def stored_on_disk(run: Engine, path: Path, /, **spec: Any) -> dict[str, Any]:
    """A disk tier under ``path`` holding what an engine process of ``spec`` stored there.

    ``spec``'s connector names ``path`` as its ``disk_path``. The storing run is paid once
    per spec in a session: its directory is kept aside untouched and copied to ``path``
    for every test that asks (tests damage, mount or add to theirs). Returns the storing
    run's result; the caller checks it.
    """
    connector = spec["connector"]
    key = json.dumps({**spec, "connector": {**connector, "disk_path": None}}, sort_keys=True)
    if key not in _STORED:
        kept = Path(tempfile.mkdtemp(prefix="kvoffload-stored-")) / "kv"
        result = run(**{**spec, "connector": {**connector, "disk_path": str(kept)}})
        _STORED[key] = (kept, result)
    kept, result = _STORED[key]
    shutil.copytree(kept, path)
    return result


def llama_stored_on_disk(
    run: Engine, reference: Reference, llama: str, path: Path, blocks_per_chunk: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(spec, expected)``: ``LLAMA_PROMPTS`` stored on a disk tier under ``path`` by an
    engine process of their own, so the next process run on ``spec`` finds them on disk only."""
    expected = reference(llama, LLAMA_ENGINE, LLAMA_PROMPTS)
    connector = with_disk(
        path, "64MiB", blocks_per_chunk=blocks_per_chunk, cpu_bytes_to_use="64MiB"
    )
    spec = {"model": llama, "engine": LLAMA_ENGINE, "prompts": LLAMA_PROMPTS,
            "connector": connector}  # fmt: skip
    assert_cold_store(stored_on_disk(run, path, **spec), expected)
    return spec, expected
