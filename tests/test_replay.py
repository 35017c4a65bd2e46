"""Trace replay: loading, both replays, Belady's bound and the ``replay`` command.

Small traces written to ``tmp_path`` have answers worked out by hand; a slice
of the real Mooncake trace checks the index-only loop against figures vLLM
0.32's ``CPUOffloadingManager`` produced on the same slice, and the engine
replay (the connector's own path) for repeatability and bounds.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvoffload import cli
from kvoffload.errors import ConfigError
from kvoffload.registry import POLICIES
from kvoffload.replay import (
    Trace,
    belady_hits,
    block_key,
    format_table,
    load_trace,
    plot_hit_ratio,
    replay,
    sweep,
)
from kvoffload.replay.engine import EngineSettings, format_misses, replay_engine

#: The first 3,000 requests of the Mooncake conversation trace (see tests/data/README.md).
CONVERSATION = Path(__file__).resolve().parent / "data" / "mooncake_conversation_3000.jsonl"


def write_trace(path: Path, requests: Sequence[Sequence[int]]) -> Path:
    lines = [json.dumps({"timestamp": i, "hash_ids": list(ids)}) for i, ids in enumerate(requests)]
    path.write_text("\n".join(lines) + "\n")
    return path


def keys(*requests: Sequence[int]) -> tuple[tuple[bytes, ...], ...]:
    return tuple(tuple(block_key(i) for i in ids) for ids in requests)


# -- loading --------------------------------------------------------------------
def test_a_trace_becomes_packed_keys_one_per_block(tmp_path: Path) -> None:
    trace = load_trace(write_trace(tmp_path / "t.jsonl", [[0, 1, 2], [0, 3]]))
    assert trace.requests == keys([0, 1, 2], [0, 3])
    assert block_key(1) == (1).to_bytes(8, "big")
    assert (trace.num_blocks, trace.num_unique, trace.name) == (5, 4, "t.jsonl")
    # One bytes object per hash id, shared between requests.
    assert trace.requests[0][0] is trace.requests[1][0]
    assert trace.head(1).requests == keys([0, 1, 2])


def test_gzip_traces_and_limits_are_read(tmp_path: Path) -> None:
    plain = write_trace(tmp_path / "t.jsonl", [[1], [2], [3]])
    packed = tmp_path / "t.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert load_trace(packed).requests == load_trace(plain).requests
    assert load_trace(packed, limit=2).requests == keys([1], [2])


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ("", "holds no requests"),
        ("{not json\n", "t.jsonl:1: not JSON"),
        ('{"hash_ids": [1]}\n{"input_length": 3}\n', "t.jsonl:2: 'hash_ids'"),
        ('{"hash_ids": [-1]}\n', "non-negative"),
        ('{"hash_ids": [true]}\n', "64-bit integers"),
        ("[1, 2]\n", "'hash_ids'"),
    ],
)
def test_bad_traces_are_config_errors_naming_the_line(
    tmp_path: Path, content: str, fragment: str
) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(content)
    with pytest.raises(ConfigError, match=fragment):
        load_trace(path)


def test_a_missing_or_unreadable_trace_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_trace(tmp_path / "absent.jsonl")
    broken = tmp_path / "broken.jsonl.gz"
    broken.write_bytes(b"not gzip at all")
    with pytest.raises(ConfigError, match="cannot read trace"):
        load_trace(broken)


# -- the loop, by hand ----------------------------------------------------------------
def test_lru_prefix_hits_on_a_tiny_trace_match_a_hand_count() -> None:
    # Capacity 2. r1 stores 1,2. r2 hits both, touching 2 then 1 (1 is newest).
    # r3 evicts 2 for 3. r4 hits 1, misses 2, stores it by evicting 3: 3 hits of 7.
    trace = Trace("tiny", keys([1, 2], [1, 2], [3], [1, 2]))
    result = replay(trace, 2, "lru")
    assert (result.hit_blocks, result.blocks, result.requests) == (3, 7, 4)
    assert result.hit_ratio == pytest.approx(3 / 7)
    assert result.keys_per_s > 0
    assert result.policy == "lru"


def test_lru_evicts_chain_tails_before_heads() -> None:
    # Capacity 3: [1,2,3] then [9]: the victim is the tail 3, so [1,2,3] still hits 1 and 2.
    trace = Trace("tails", keys([1, 2, 3], [9], [1, 2, 3]))
    assert replay(trace, 3, "lru").hit_blocks == 2


def test_a_hit_after_a_miss_does_not_count() -> None:
    # Block 2 is stored, but 1 is not (too big a request first): prefix semantics score 0.
    trace = Trace("gap", keys([2], [1, 2]))
    assert replay(trace, 4, "lru").hit_blocks == 0


def test_a_request_larger_than_the_cache_stores_nothing() -> None:
    trace = Trace("big", keys([1, 2, 3], [1, 2, 3]))
    assert replay(trace, 2, "lru").hit_blocks == 0


# -- Belady -------------------------------------------------------------------------
def test_belady_on_a_tiny_trace_matches_a_hand_count() -> None:
    # Capacity 2: 1,2 stay (next used at r2 and r4); 3 is never used again: bypassed.
    trace = keys([1, 2], [1, 2], [3], [1, 2])
    assert belady_hits(trace, 2) == 4


def test_belady_breaks_ties_by_evicting_the_chain_tail() -> None:
    # At r2, 1 and 2 are both next used at r4, 3 sooner: MIN evicts one of them.
    # Evicting the tail 2 keeps 1 usable: r3 hits 3, r4 hits 1 -> 2 (head-first would give 1).
    trace = keys([1, 2], [3], [3], [1, 2])
    assert belady_hits(trace, 2) == 2


def test_belady_rejects_a_bad_capacity() -> None:
    with pytest.raises(ConfigError, match="positive int"):
        belady_hits(keys([1]), 0)


@pytest.mark.parametrize("policy", POLICIES.names())
@pytest.mark.parametrize("capacity", [1, 3, 8])
def test_belady_bounds_every_policy_on_small_traces(policy: str, capacity: int) -> None:
    requests = keys(
        [1, 2, 3], [1, 2, 4], [5], [1, 2, 3, 6], [5, 7], [1, 8], [1, 2, 4], [5, 7], [1, 2, 3]
    )
    bound = belady_hits(requests, capacity)
    assert replay(Trace("s", requests), capacity, policy).hit_blocks <= bound


def test_belady_bounds_every_policy_on_the_real_trace() -> None:
    trace = load_trace(CONVERSATION, limit=2000)
    for capacity in (300, 1500):
        bound = belady_hits(trace.requests, capacity)
        for policy in POLICIES.names():
            assert replay(trace, capacity, policy).hit_blocks <= bound, (policy, capacity)


def test_lru_replay_matches_vllm_on_a_real_trace_slice() -> None:
    # Measured with vLLM 0.32's CPUOffloadingManager (cache_policy="lru") through
    # benchmarks/replay_vs_vllm.py's loop on the first 3000 requests (80,619 blocks).
    trace = load_trace(CONVERSATION, limit=3000)
    assert trace.num_blocks == 80_619
    assert replay(trace, 500, "lru").hit_blocks == 3071
    assert replay(trace, 2000, "lru").hit_blocks == 3950


def test_progress_bar_goes_to_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    result = replay(Trace("p", keys([1], [1])), 2, "lru", progress=True)
    assert result.hit_blocks == 1
    assert capsys.readouterr().out == ""


def test_sweep_rows_and_table() -> None:
    trace = Trace("s", keys([1, 2], [1, 2], [3], [1, 2]))
    rows = sweep(trace, [1, 2], ["lru", "adaptive"])
    assert [(r.capacity, r.policy) for r in rows] == [
        (1, "lru"),
        (1, "adaptive"),
        (2, "lru"),
        (2, "adaptive"),
    ]
    assert rows[2].bound == pytest.approx(4 / 7)
    assert all(r.bound is not None and r.hit_ratio <= r.bound for r in rows)
    table = format_table(rows)
    assert table.splitlines()[3].split()[:3] == ["lru", "2", "0.4286"]
    assert sweep(trace, [2], ["lru"], bound=False)[0].bound is None


# -- plots ---------------------------------------------------------------------------
def test_the_plot_is_a_real_png(tmp_path: Path) -> None:
    rows = sweep(Trace("s", keys([1, 2], [1, 2], [3], [1, 2])), [1, 2, 4], ["lru", "s3fifo"])
    path = plot_hit_ratio(rows, tmp_path / "hit.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_plotting_without_matplotlib_gives_the_install_hint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(__import__("sys").modules, "matplotlib.figure", None)
    with pytest.raises(ConfigError, match=r"pip install 'kvoffload\[plot\]'"):
        plot_hit_ratio([], tmp_path / "x.png")


def test_an_unwritable_plot_path_is_a_config_error(tmp_path: Path) -> None:
    rows = sweep(Trace("s", keys([1])), [1], ["lru"], bound=False)
    with pytest.raises(ConfigError, match="cannot write plot"):
        plot_hit_ratio(rows, tmp_path / "missing-dir" / "x.png")


# -- the command ------------------------------------------------------------------------
@pytest.fixture
def replay_cli(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the replay subcommand, so these tests do not depend on the others."""
    monkeypatch.setattr(cli, "SUBCOMMANDS", ("replay",))


@pytest.mark.usefixtures("replay_cli")
def test_cli_json_rows_parse(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_trace(tmp_path / "t.jsonl", [[1, 2], [1, 2], [3], [1, 2]])
    code = cli.main(["replay", str(trace), "--capacities", "1,2", "--index-only", "--json"])
    assert code == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 2 * len(POLICIES.names())
    lru = next(r for r in rows if r["policy"] == "lru" and r["capacity"] == 2)
    assert lru["hit_blocks"] == 3 and lru["blocks"] == 7
    assert lru["bound"] == pytest.approx(4 / 7)
    assert lru["keys_per_s"] > 0


@pytest.mark.usefixtures("replay_cli")
def test_cli_table_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_trace(tmp_path / "t.jsonl", [[1, 2], [1, 2], [3], [1, 2]])
    png = tmp_path / "hit.png"
    code = cli.main(
        ["replay", str(trace), "--capacity", "2", "--policy", "lru", "--index-only",
         "--plot", str(png)]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert "4 requests, 7 blocks, 3 distinct" in out
    row = out.splitlines()[2].split()
    assert row[:3] == ["lru", "2", "0.4286"] and row[4:] == ["0.5714", "75%"]
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.usefixtures("replay_cli")
@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        ([], "does not exist"),
        (["--capacities", "10,zero"], "--capacities: 'zero' is not a chunk count"),
        (["--capacity", "0"], "--capacity: '0'"),
        (["--limit", "0"], "--limit"),
        (["--gpu-blocks", "0"], "--gpu-blocks"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], fragment: str
) -> None:
    path = tmp_path / "absent.jsonl" if not extra else write_trace(tmp_path / "t.jsonl", [[1]])
    assert cli.main(["replay", str(path), *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvoffload replay: error: ")
    assert fragment in err


@pytest.mark.usefixtures("replay_cli")
def test_cli_replays_a_real_trace_slice(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(
        ["replay", str(CONVERSATION), "--limit", "500", "--capacity", "1000", "--index-only",
         "--json"]
    )  # fmt: skip
    rows = json.loads(capsys.readouterr().out)
    assert code == 0
    assert {r["policy"] for r in rows} == set(POLICIES.names())
    assert all(0 < r["hit_ratio"] <= r["bound"] <= 1 for r in rows)


# -- the engine replay: the connector's own path --------------------------------------------
def write_lengths(path: Path, requests: Sequence[Sequence[int]]) -> Path:
    lines = [
        json.dumps({"timestamp": i, "input_length": 512 * len(ids), "hash_ids": list(ids)})
        for i, ids in enumerate(requests)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_engine_replay_loads_what_the_gpu_cache_lost(tmp_path: Path) -> None:
    # GPU cache: 4 usable blocks of 512 tokens. r1 computes [1,2,3] and frees them tail
    # first; r2's 3 blocks take a fresh one and r1's tail and middle. r3 = r1 finds block 1
    # on the GPU and loads block 2 from the CPU tier (block 3 holds the token to compute).
    trace = load_trace(write_lengths(tmp_path / "t.jsonl", [[1, 2, 3], [4, 5, 6], [1, 2, 3]]))
    settings = EngineSettings(gpu_blocks=5, in_flight=1)
    row = replay_engine(trace, 10, "lru", settings=settings)
    assert (row.requests, row.prompt_tokens) == (3, 3 * 1536)
    assert (row.gpu_hit_tokens, row.loaded_tokens, row.failed_load_tokens) == (512, 512, 0)
    assert row.hit_ratio == pytest.approx(1 / 9) and row.gpu_hit_ratio == pytest.approx(1 / 9)
    assert row.steps >= 4 and row.scheduler_ms_per_step > 0
    # r1 and r2 were never stored before they came; r3 loaded what it could.
    assert row.miss_tokens == {"never_stored": 2 * 1024}
    assert format_misses(row).endswith("misses (of prompt tokens): never_stored 44.4%")
    # With room for r1 on the GPU, the GPU serves everything and the connector nothing.
    roomy = replay_engine(trace, 10, "lru", settings=EngineSettings(gpu_blocks=8, in_flight=1))
    assert (roomy.gpu_hit_tokens, roomy.loaded_tokens) == (1024, 0)


def test_the_engine_replay_is_repeatable_and_bounded() -> None:
    # The first 300 requests share little but a one-block system prompt, which the GPU
    # cache keeps; what comes back from further away needs room in the CPU tier.
    trace = load_trace(CONVERSATION, limit=300)
    settings = EngineSettings(gpu_blocks=250)  # request 97 alone needs 236 blocks
    a, b = (replay_engine(trace, 5000, "adaptive", settings=settings) for _ in range(2))
    assert (a.loaded_tokens, a.gpu_hit_tokens, a.steps) == (
        b.loaded_tokens,
        b.gpu_hit_tokens,
        b.steps,
    )
    assert a.loaded_tokens > 0 and a.gpu_hit_tokens > 0
    assert a.prompt_tokens == sum(trace.lengths)
    # What neither cache served was computed: never more hits than prompt tokens.
    assert a.gpu_hit_tokens + a.loaded_tokens < a.prompt_tokens
    # Orders completed at once (no bytes moved, as vLLM's connector runs in the comparison
    # with it) find the same hits as the settled run that moved them.
    quick = replay_engine(trace, 5000, "adaptive", settings=settings, transfers=False)
    assert (quick.loaded_tokens, quick.gpu_hit_tokens, quick.steps) == (
        a.loaded_tokens,
        a.gpu_hit_tokens,
        a.steps,
    )


@pytest.mark.usefixtures("replay_cli")
def test_cli_replays_through_the_connector_by_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = write_lengths(tmp_path / "t.jsonl", [[1, 2, 3], [4, 5, 6], [1, 2, 3]])
    assert cli.main(["replay", str(trace), "--capacity", "10", "--gpu-blocks", "5", "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)
    assert (row["connector"], row["policy"], row["gpu_blocks"]) == ("kvoffload", "adaptive", 5)
    assert 0 <= row["hit_ratio"] < 1 and row["prompt_tokens"] == 3 * 1536
    assert cli.main(["replay", str(trace), "--capacity", "10", "--policy", "lru"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].split()[:3] == ["connector", "policy", "capacity"]
    assert out[2].split()[:4] == ["kvoffload", "lru", "10", "1000"]


def test_the_engine_replay_of_lru_matches_vllms_connector_on_a_real_trace_slice() -> None:
    # Measured with vLLM 0.32's OffloadingConnector (CPUOffloadingSpec, eviction_policy
    # "lru") in the same stand-in engine through benchmarks/replay_vs_vllm.py's vllm_row,
    # on the first 1000 requests: 1616 steps, 511,488 tokens from the GPU prefix cache and
    # 27,136 loaded from the CPU tier, of 13,732,944 prompt tokens.
    trace = load_trace(CONVERSATION, limit=1000)
    row = replay_engine(trace, 1000, "lru", settings=EngineSettings(gpu_blocks=300))
    assert (row.steps, row.prompt_tokens) == (1616, 13_732_944)
    assert (row.gpu_hit_tokens, row.loaded_tokens) == (511_488, 27_136)
