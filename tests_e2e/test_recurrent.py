"""Recurrent hybrids on a real vLLM engine: a tiny Qwen3-Next (three gated-DeltaNet layers,
one full-attention layer) served exactly from the connector's tiers.

The oracle is vLLM's own prefix cache: the same prompts run twice in one
engine without a reset give tokens computed from the same state and KV
(``reference``'s second pass). With the connector, the second pass runs
after ``reset_prefix_cache()``, so only the connector can serve the history:
it must give exactly the oracle's tokens and hits. The model's gated-DeltaNet
state is made to last (``_models.QWEN3_NEXT``): with the state the connector
loads replaced by zeros, every prompt's tokens differ from the first one on
(checked by hand when this suite was written), so a wrong state cannot pass.
"""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _harness import (
    ALONE,
    TWO_PASSES,
    Engine,
    Reference,
    alone_oracle,
    assert_loaded_tokens_match,
    connector_hit,
    delta,
    differences,
    negative_control,
    own_cache_alone_oracle,
    own_cache_one_by_one,
    shared_prefix_prompts,
    stored_on_disk,
    with_disk,
)

#: vLLM keeps a state at each block boundary only with prefix caching in "align" mode.
QWEN_ENGINE: dict[str, Any] = {
    "enable_prefix_caching": True,
    "mamba_cache_mode": "align",
    "max_model_len": 4096,
}
#: Three prompts (1120-1122 tokens) sharing 1,100: vLLM stops the prefill at the last block
#: boundary before the last token and keeps the state there.
QWEN_PROMPTS = shared_prefix_prompts(3, prefix_len=1100, suffix_len=20, vocab=512)


def block_size(result: dict[str, Any]) -> int:
    """vLLM's one block size of the four groups (three state groups, then attention).

    vLLM's CPU backend picks it from the attention page and the state's size,
    which depend on the processor: 256 tokens on some machines, 384 on others
    (AMX ones, and a 2-core AVX-512 Xeon without AMX), so nothing here assumes one.
    """
    groups = result["kv_cache_groups"]
    assert len(groups) == 4 and len(set(groups)) == 1, groups
    return int(groups[0])


def assert_like_the_oracle(result: dict[str, Any], oracle: dict[str, Any]) -> None:
    """Pass by pass, the oracle's tokens and logprobs; in the last pass its hits too."""
    assert result["error"] is None, result["error"]
    block_size(result)
    for n, (done, want) in enumerate(zip(result["passes"], oracle["passes"], strict=False)):
        found = differences(done, want)
        assert not found, f"pass {n}: " + "; ".join(found)
    assert result["passes"][-1]["cached"] == oracle["passes"][-1]["cached"]


@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_qwen3_next_round_trip(engine: Engine, qwen3_next: str, blocks_per_chunk: int) -> None:
    """vLLM's own prefix cache's tokens, logprobs and hits, from the connector after a reset.

    The second pass goes one prompt at a time (and after a reset before each, every hit is
    the connector's): on CPUs with AMX a Qwen3-Next prompt's logprobs follow what else is
    batched with it (0.08 apart between a batch of three and alone, measured), and the
    connector's loads one step later batch the prompts otherwise than vLLM's own cache does.
    """
    oracle = own_cache_one_by_one(engine, qwen3_next, QWEN_ENGINE, QWEN_PROMPTS)
    connector = {"blocks_per_chunk": blocks_per_chunk, "cpu_bytes_to_use": "256MiB"}
    passes = [{}, {"reset": True, **ALONE}]
    spec = {"model": qwen3_next, "engine": QWEN_ENGINE, "prompts": QWEN_PROMPTS,
            "passes": passes, "connector": connector}  # fmt: skip
    result = engine(**spec)
    assert_like_the_oracle(result, oracle)
    chunk = block_size(result) * blocks_per_chunk
    hit = connector_hit(QWEN_PROMPTS[0], chunk)
    assert hit > 0 and result["passes"][1]["cached"] == [hit] * 3
    assert_loaded_tokens_match(result, 1)
    scheduler, worker = result["stats"]["scheduler"], result["stats"]["worker"]
    assert scheduler["failed_loads"] == 0 and worker.get("failed_load_chunks", 0) == 0
    # Pass 1 stored the attention chunks up to the hit and one state per group there.
    assert delta(result, 0, "scheduler", "stored_chunks") == hit // chunk + 3
    if blocks_per_chunk == 1:  # the negative control: every loaded state (and KV block) damaged
        check = lambda r: assert_like_the_oracle(r, oracle)  # noqa: E731
        negative_control(engine, check, "load.corrupt_block", **spec)


def issue_29_prompts(prefix_len: int, tails: tuple[int, ...]) -> list[list[int]]:
    """Three prompts sharing ``prefix_len`` tokens, then ``tails``, and one unrelated
    prompt, in one ``generate`` (issue 29: 1300 tokens, tails of 70, 93 and 116)."""
    rng = random.Random(29)
    prefix = [rng.randrange(1, 512) for _ in range(prefix_len)]
    shared = [prefix + [rng.randrange(1, 512) for _ in range(tail)] for tail in tails]
    return [*shared, [rng.randrange(1, 512) for _ in range(prefix_len)]]


@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_qwen3_next_issue_29_prompts_hit_as_vllm_does(
    engine: Engine, reference: Reference, qwen3_next: str, blocks_per_chunk: int
) -> None:
    """Each prompt's state sits at its last block boundary (1280 or 1152 tokens): a chunk
    end at one block per chunk, inside a chunk at two, where the prompt stores a tail
    there (``kvoffload.connector._tails``). Either way every prompt gets vLLM's own hit
    from the tiers after the reset, the first included, and vLLM's tokens."""
    prompts = issue_29_prompts(1300, (70, 93, 116))
    expected = reference(qwen3_next, QWEN_ENGINE, prompts)
    connector = {"cpu_bytes_to_use": "256MiB", "blocks_per_chunk": blocks_per_chunk}
    result = engine(model=qwen3_next, engine=QWEN_ENGINE, prompts=prompts, passes=TWO_PASSES,
                    connector=connector)  # fmt: skip
    assert result["error"] is None, result["error"]
    assert [p["tokens"] for p in result["passes"]] == [expected["passes"][0]["tokens"]] * 2
    hit = 1299 // block_size(result) * block_size(result)
    assert result["passes"][1]["cached"] == expected["passes"][1]["cached"] == [hit] * 4
    assert_loaded_tokens_match(result, 1)
    assert result["stats"]["scheduler"]["failed_loads"] == 0


def test_qwen3_next_two_blocks_per_chunk_hits_on_chunk_ends_and_tails(
    engine: Engine, reference: Reference, qwen3_next: str
) -> None:
    """At 2 blocks per chunk the shared prefix's state is at 1536 tokens, two chunks of 768
    or three of 512 on either CPU block size; the third prompt's own last boundary (1792
    or 1920) lies on an odd block, past the prefix: a tail, served as vLLM's own cache
    serves it. The connector warns at start of what tails do not cover."""
    prompts = issue_29_prompts(1596, (70, 193, 330))
    expected = reference(qwen3_next, QWEN_ENGINE, prompts)
    # vLLM's own prefix cache: 1536 for the first two, the third its own later state too.
    assert expected["passes"][1]["cached"][:2] == [1536] * 2
    result = engine(model=qwen3_next, engine=QWEN_ENGINE, prompts=prompts, passes=TWO_PASSES,
                    connector={"blocks_per_chunk": 2, "cpu_bytes_to_use": "256MiB"})  # fmt: skip
    assert result["error"] is None, result["error"]
    assert [p["tokens"] for p in result["passes"]] == [expected["passes"][0]["tokens"]] * 2
    # The third's own state inside a chunk too (its tail); the unrelated prompt its own.
    block = block_size(result)
    assert result["passes"][1]["cached"] == expected["passes"][1]["cached"]
    assert result["passes"][1]["cached"] == [1536, 1536, (1595 + 330) // block * block, 1536]
    assert_loaded_tokens_match(result, 1)
    assert result["stats"]["scheduler"]["failed_loads"] == 0
    log = Path(result["log"]).read_text()
    assert log.count("blocks_per_chunk=2 with recurrent state groups") == 1


@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_qwen3_next_next_turn_hits_the_output_end(
    engine: Engine, qwen3_next: str, blocks_per_chunk: int
) -> None:
    """A second turn (prompt, 200 generated tokens, 40 more) resumes at the output's end.

    The state at the output's last block boundary existed only while decoding; the connector
    kept it as the request's trailing hit point (at two blocks per chunk a tail where that
    boundary is an odd block). vLLM's own cache keeps it too when it retains every boundary
    (the oracle's retention interval).
    """
    prompts = QWEN_PROMPTS[:2]
    args = {**QWEN_ENGINE, "prefix_cache_retention_interval": None}
    follow = {"follow_up": 40}
    oracle = engine(model=qwen3_next, engine=args, prompts=prompts, max_tokens=200,
                    passes=[{}, follow], memo=True)  # fmt: skip
    block = block_size(oracle)
    # The KV of every token but the last generated one: its last full block is the output end.
    ends = [(len(p) + 200 - 1) // block * block for p in prompts]
    assert oracle["passes"][1]["cached"] == ends and min(ends) > len(prompts[1]), ends
    result = engine(
        model=qwen3_next, engine=args, prompts=prompts, max_tokens=200,
        passes=[{}, {"reset": True, **follow}],
        connector={"cpu_bytes_to_use": "256MiB", "blocks_per_chunk": blocks_per_chunk},
    )  # fmt: skip
    assert_like_the_oracle(result, oracle)
    assert_loaded_tokens_match(result, 1)
    assert result["stats"]["scheduler"]["failed_loads"] == 0


def qwen_stored_on_disk(engine: Engine, model: str, path: Path) -> dict[str, Any]:
    """``QWEN_PROMPTS`` stored on a disk tier under ``path`` by an engine process of their own
    (paid once a session: ``stored_on_disk``); that process's result."""
    connector = with_disk(path, "256MiB", cpu_bytes_to_use="256MiB")
    spec = {"model": model, "engine": QWEN_ENGINE, "prompts": QWEN_PROMPTS}
    first = stored_on_disk(engine, path, **spec, connector=connector)
    assert first["error"] is None and first["stats"]["scheduler"]["stored_chunks"] > 0
    return first


def state_files(directory: Path, result: dict[str, Any]) -> list[Path]:
    """The chunk files of recurrent states: their payload is one state, not attention KV.

    A file is a 4 KiB header and the payload padded to 4 KiB; the state's bytes are
    vLLM's (conv and SSM state, the SSM one in bfloat16 or float32 by processor).
    """
    state = result["kv_cache_state_bytes"][0]
    assert state > 0 and result["kv_cache_state_bytes"][-1] == 0
    size = 4096 + -(-state // 4096) * 4096
    return [p for p in sorted(directory.rglob("*.kv")) if p.stat().st_size == size]


def test_qwen3_next_disk_restart_and_corrupt_states(
    engine: Engine, qwen3_next: str, tmp_path: Path
) -> None:
    """A fresh process loads from the disk tier; damaged states are recomputed, same tokens."""
    connector = with_disk(tmp_path / "kv", "256MiB", cpu_bytes_to_use="256MiB")
    first = qwen_stored_on_disk(engine, qwen3_next, tmp_path / "kv")
    assert len(state_files(tmp_path / "kv", first)) == 3  # one state per group, at the hit

    # Disk hits load over later steps: one prompt at a time (a batch would be a timing).
    second = engine(model=qwen3_next, engine=QWEN_ENGINE, prompts=QWEN_PROMPTS,
                    connector=connector, passes=[ALONE])  # fmt: skip
    oracle = own_cache_alone_oracle(engine, qwen3_next, QWEN_ENGINE, QWEN_PROMPTS)
    assert_like_the_oracle(second, oracle)
    assert second["stats"]["scheduler"]["lower_hit_chunks"] > 0
    assert_loaded_tokens_match(second, 0)

    damaged = state_files(tmp_path / "kv", first)
    for path in damaged:  # the states only: the attention chunks stay sound
        data = bytearray(path.read_bytes())
        data[len(data) // 2 : len(data) // 2 + 64] = bytes(64)
        path.write_bytes(bytes(data))
    logging = {**QWEN_ENGINE, "disable_log_stats": False}  # vLLM counts what it computed
    third = engine(model=qwen3_next, engine=logging, prompts=QWEN_PROMPTS, passes=[ALONE],
                   connector=connector, failure_policy="recompute")  # fmt: skip
    assert third["error"] is None, third["error"]
    alone = alone_oracle(engine, qwen3_next, QWEN_ENGINE, QWEN_PROMPTS)
    found = differences(third["passes"][0], alone["passes"][0])
    assert not found, "; ".join(found)
    scheduler, worker = third["stats"]["scheduler"], third["stats"]["worker"]
    assert scheduler["failed_loads"] > 0 and worker["failed_load_jobs"] > 0
    assert worker["tiers"]["disk"]["corrupt"] == len(damaged) == 3
    # What vLLM saw: it counts no cached token for the first prompt and computed it whole.
    assert third["passes"][0]["cached"][0] == 0, third["passes"][0]["cached"]
    computed = third["metrics"]["vllm:request_prefill_kv_computed_tokens_sum"]
    assert computed >= len(QWEN_PROMPTS[0]), computed


@contextlib.contextmanager
def read_only(directory: Path) -> Iterator[None]:
    """``directory`` bind-mounted read-only onto itself (root with CAP_SYS_ADMIN; skipped
    elsewhere, a failure where ``KVOFFLOAD_REQUIRE_MOUNT`` is set, as in CI)."""
    done = subprocess.run(["mount", "--bind", str(directory), str(directory)],
                          capture_output=True, text=True, check=False)  # fmt: skip
    if done.returncode:
        reason = f"cannot bind-mount {directory} ({done.stderr.strip()}): needs root"
        if os.environ.get("KVOFFLOAD_REQUIRE_MOUNT"):
            pytest.fail(reason)
        pytest.skip(reason)
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(directory)], check=True)
        yield
    finally:
        subprocess.run(["umount", str(directory)], check=True)


def test_qwen3_next_read_only_disk_cache_is_served(
    engine: Engine, reference: Reference, qwen3_next: str, tmp_path: Path
) -> None:
    """A cache one engine filled, shipped read-only to a fresh one: served, stores skipped."""
    expected = reference(qwen3_next, QWEN_ENGINE, QWEN_PROMPTS)
    connector = with_disk(tmp_path / "kv", "256MiB", cpu_bytes_to_use="256MiB")
    qwen_stored_on_disk(engine, qwen3_next, tmp_path / "kv")
    new = shared_prefix_prompts(1, prefix_len=1100, suffix_len=20, vocab=512, seed=7)
    with read_only(tmp_path / "kv"):  # the same prompts, then one it has not seen
        second = engine(model=qwen3_next, engine=QWEN_ENGINE, prompts=QWEN_PROMPTS,
                        passes=[{}, {"prompts": new}], connector=connector)  # fmt: skip
    assert second["error"] is None, second["error"]
    assert second["passes"][0]["tokens"] == expected["passes"][0]["tokens"]
    assert second["passes"][0]["cached"] == expected["passes"][1]["cached"]  # vLLM's own cache
    assert_loaded_tokens_match(second, 0)
    disk = second["stats"]["worker"]["tiers"]["disk"]
    assert disk["read_only"] == 1 and disk["loads"] > 0 and disk["read_only_skips"] > 0
    assert disk["store_failures"] == 0 and disk["load_failures"] == 0
    log = Path(second["log"]).read_text()
    assert log.count(f"disk_path {str(tmp_path / 'kv')!r} is read-only (it is on a read-only") == 1


def test_qwen3_next_without_boundary_states_is_refused(engine: Engine, qwen3_next: str) -> None:
    """Without prefix caching vLLM keeps one running state per request (mode "none")."""
    args = {"enable_prefix_caching": False}
    result = engine(model=qwen3_next, engine={"max_model_len": 4096, **args},
                    prompts=QWEN_PROMPTS[:1], connector={"cpu_bytes_to_use": "64MiB"})  # fmt: skip
    assert result["error"] is not None, "the engine started"
    assert "ConfigError" in result["error"]
    assert 'mamba_cache_mode="align"' in result["error"]
    assert "enable_prefix_caching=True" in result["error"]
