"""The arrival replay: requests at their timestamps, a waiting queue, hints from the trace.

Small traces written to ``tmp_path`` have answers worked out by hand (when a request
waits, what it finds, what a client would say of it); a slice of the Mooncake
conversation trace shows what the queue and the hints change, through the
connector's real scheduler side.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvoffload.errors import ConfigError
from kvoffload.replay import load_trace
from kvoffload.replay.arrival_report import (
    format_arrival_table,
    parse_hint_modes,
    sweep_arrivals,
)
from kvoffload.replay.arrivals import arrival_bound, replay_arrivals, service_rate
from kvoffload.replay.engine import EngineSettings
from kvoffload.replay.foresight import DROP_PRIORITY, KEEP_PRIORITY, trace_hints, typical_gap
from tests._cli import kvoffload

CONVERSATION = Path(__file__).resolve().parent / "data" / "mooncake_conversation_3000.jsonl"


def write_trace(path: Path, requests: Sequence[tuple[float, Sequence[int], int]]) -> Path:
    """Requests as (timestamp in ms, hash ids, input length)."""
    lines = [
        json.dumps({"timestamp": t, "input_length": n, "hash_ids": list(ids)})
        for t, ids, n in requests
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def ranges(params: object) -> list[dict[str, object]]:
    assert isinstance(params, dict)
    token_ranges = params["kv_retention"]["token_ranges"]
    assert isinstance(token_ranges, list)
    return token_ranges


# -- arrivals and the service rate ---------------------------------------------------
def test_timestamps_are_read_as_seconds_and_a_bad_one_is_refused(tmp_path: Path) -> None:
    trace = load_trace(write_trace(tmp_path / "t.jsonl", [(0, [1], 10), (1500, [1, 2], 600)]))
    assert trace.arrivals == (0.0, 1.5)
    assert trace.head(1).arrivals == (0.0,)
    (tmp_path / "some.jsonl").write_text('{"hash_ids": [1]}\n{"timestamp": 5, "hash_ids": [2]}\n')
    assert load_trace(tmp_path / "some.jsonl").arrivals == ()  # not every request has one
    (tmp_path / "bad.jsonl").write_text('{"timestamp": "soon", "hash_ids": [1]}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:1: 'timestamp' 'soon' is not a time"):
        load_trace(tmp_path / "bad.jsonl")


def test_the_rate_offers_the_load_and_a_trace_that_cannot_is_refused(tmp_path: Path) -> None:
    trace = load_trace(write_trace(tmp_path / "t.jsonl", [(0, [1], 400), (2000, [2], 500)]))
    assert service_rate(trace, 0.5) == pytest.approx(900 / (0.5 * 2.0))
    at_once = load_trace(write_trace(tmp_path / "o.jsonl", [(7, [1], 9), (7, [2], 9)]))
    with pytest.raises(ConfigError, match="every request arrives at once"):
        service_rate(at_once, 0.9)
    (tmp_path / "u.jsonl").write_text('{"hash_ids": [1]}\n')
    with pytest.raises(ConfigError, match="no 'timestamp' on every request"):
        service_rate(load_trace(tmp_path / "u.jsonl"), 0.9)


def test_requests_that_arrive_together_wait_and_spaced_ones_do_not(tmp_path: Path) -> None:
    """Four prompts of 2048 tokens at once on an engine of 512 tokens a step: they queue.
    The same four a second apart at a low load: nobody waits."""
    prompts = [[10 * i + b for b in range(4)] for i in range(4)]
    burst = write_trace(
        tmp_path / "b.jsonl", [(0, ids, 2048) for ids in prompts] + [(60_000, [99], 9)]
    )
    spaced = write_trace(
        tmp_path / "s.jsonl", [(1000 * i, ids, 2048) for i, ids in enumerate(prompts)]
    )
    settings = EngineSettings(gpu_blocks=64, step_tokens=512)
    waited = replay_arrivals(load_trace(burst), 16, "lru", load=0.5, settings=settings)
    assert waited.queue.most >= 3 and waited.queue.wait_mean_s > 0
    calm = replay_arrivals(load_trace(spaced), 16, "lru", load=0.1, settings=settings)
    assert calm.queue.most == 0 and calm.queue.wait_mean_s == 0
    assert calm.requests == 4 and calm.prompt_tokens == 4 * 2048
    assert 0 < calm.queue.busy < 0.5


def test_a_queued_request_keeps_its_chunks_through_the_stores_of_those_ahead(
    tmp_path: Path,
) -> None:
    """A first turn stores 4 chunks; then a long request and the next turn arrive at once.
    The long one runs first: its 11 blocks push the first turn out of a GPU cache of 12,
    and its stores would evict it from a CPU tier of 8, but the next turn waits behind it
    with its chunks held, so it loads them. Without holds it recomputes them."""
    first = [1, 2, 3, 4]
    long = list(range(100, 111))
    trace = load_trace(
        write_trace(
            tmp_path / "t.jsonl",
            [(0, first, 2048), (10_000, long, 5632), (10_000, [*first, 5], 2100)],
        )
    )
    settings = EngineSettings(gpu_blocks=12, step_tokens=512)
    held = replay_arrivals(trace, 8, "lru", load=0.5, settings=settings, queued_cpu_share=0.5)
    bare = replay_arrivals(trace, 8, "lru", load=0.5, settings=settings, queued_cpu_share=0.0)
    assert held.counters["queued_held_chunks"] == 4 and bare.counters["queued_holds"] == 0
    assert held.gpu_hit_tokens == bare.gpu_hit_tokens == 0
    assert held.loaded_tokens == 4 * 512  # the next turn's whole first turn, from the tier
    assert bare.loaded_tokens == 0


# -- hints from the trace -----------------------------------------------------------
def test_a_client_that_knows_the_trace_keeps_what_continues_and_drops_what_ends(
    tmp_path: Path,
) -> None:
    """A turn whose new part a later request reads is kept until that request arrives (and
    a margin); one whose new part nobody reads is dropped; what was seen before is left."""
    trace = load_trace(
        write_trace(
            tmp_path / "t.jsonl",
            [
                (0, [0, 1, 2], 1500),  # a first turn: its 2 whole blocks read again below
                (5_000, [0, 7, 8], 1500),  # another conversation, never continued
                (30_000, [0, 1, 2, 3, 4], 2100),  # the first's next turn, never continued
                (31_000, [0, 1], 1024),  # adds no whole block: nothing to say
            ],
        )
    )
    first, other, last, nothing = trace_hints(trace)
    keep = {"token_start": 0, "token_end": 1024, "priority": KEEP_PRIORITY}
    assert ranges(first) == [{**keep, "duration_ms": 90_000}]  # until the next turn + 60 s
    assert ranges(other) == [{"token_start": 512, "token_end": None, "priority": DROP_PRIORITY}]
    assert ranges(last) == [{"token_start": 1536, "token_end": None, "priority": DROP_PRIORITY}]
    assert nothing is None


def test_a_client_that_guesses_is_wrong_as_often_as_said_and_keeps_for_its_guess() -> None:
    trace = load_trace(CONVERSATION, limit=2000)
    perfect, guessed = trace_hints(trace), trace_hints(trace, 0.8, seed=3)
    said = [(p, g) for p, g in zip(perfect, guessed, strict=True) if p is not None]
    flipped = sum(ranges(p)[0]["priority"] != ranges(g)[0]["priority"] for p, g in said)
    assert 0.15 < flipped / len(said) < 0.25
    kept = [ranges(g)[0] for _, g in said if ranges(g)[0]["priority"] == KEEP_PRIORITY]
    assert {r["duration_ms"] for r in kept} == {round(typical_gap(trace) * 1000)}
    assert 30 < typical_gap(trace) < 600  # the trace's median time to a next turn
    assert trace_hints(trace, 0.8, seed=3) == guessed  # a fixed seed: a run repeats
    with pytest.raises(ConfigError, match=r"accuracy 1\.5 is not in"):
        trace_hints(trace, 1.5)


def test_hints_parse_as_the_connector_parses_a_client(tmp_path: Path) -> None:
    from kvoffload.connector.hints import parse_hint

    trace = load_trace(CONVERSATION, limit=300)
    parsed = [parse_hint(p) for p in trace_hints(trace) if p is not None]
    assert parsed and all(isinstance(p, tuple) for p in parsed)


# -- on the Mooncake slice -------------------------------------------------------------
def test_on_the_mooncake_slice_a_knowing_client_raises_the_hit_ratio_towards_belady() -> None:
    """The same 1500 requests at a load of 0.9, LRU at 4000 chunks: with the trace's
    knowledge as hints the connector serves more, and never more than Belady."""
    trace = load_trace(CONVERSATION, limit=1500)
    modes = parse_hint_modes("none,perfect")
    rows = sweep_arrivals(trace, [4000], ["lru"], modes, load=0.9, settings=EngineSettings())
    blind, knowing = rows
    assert blind.bound == knowing.bound == arrival_bound(trace, 5000)
    assert blind.hit_ratio < knowing.hit_ratio <= knowing.bound
    assert knowing.counters["retention_hints"] > 0 and blind.counters["retention_hints"] == 0
    assert blind.queue.mean > 1  # a load of 0.9 makes a queue
    table = format_arrival_table(rows)
    assert "perfect" in table and "of Belady" in table


def test_hint_modes_are_checked() -> None:
    assert [m.label for m in parse_hint_modes("none, perfect,0.8,0.8")] == [
        "none",
        "perfect",
        "80% right",
    ]
    for bad in ("sometimes", "1", "0", "nan", ""):
        with pytest.raises(ConfigError, match=r"--hints: .* is not a client"):
            parse_hint_modes(bad)


# -- the command ------------------------------------------------------------------------
def test_replay_arrivals_prints_each_client_beside_lru_and_belady(tmp_path: Path) -> None:
    ran = kvoffload("replay", CONVERSATION, "--arrivals", "--limit", "300", "--capacity", "500",
                    "--hints", "none,perfect", "--json")  # fmt: skip
    assert ran.code == 0, ran.err
    rows = json.loads(ran.out)
    assert [(r["policy"], r["hints"]) for r in rows] == [
        ("adaptive", "none"),
        ("lru", "none"),
        ("adaptive", "perfect"),
        ("lru", "perfect"),
    ]
    assert all(0 <= r["hit_ratio"] <= r["bound"] for r in rows)


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--arrivals", "--index-only"], "--arrivals and --index-only do not go together"),
        (["--arrivals", "--drafter", "eagle"], "--arrivals and --drafter eagle"),
        (["--load", "0.5"], "--load needs --arrivals"),
        (["--hints", "perfect"], "--hints needs --arrivals"),
        (["--arrivals", "--load", "1"], "argument --load: 1 is out of range"),
        (["--arrivals", "--hints", "maybe"], "--hints: 'maybe' is not a client"),
    ],
)
def test_replay_arrivals_refuses_bad_flags_in_one_line(argv: list[str], fragment: str) -> None:
    ran = kvoffload("replay", CONVERSATION, "--limit", "10", *argv)
    assert ran.code == 2 and ran.out == ""
    assert ran.err.count("\n") == 1 and fragment in ran.err, ran.err


def test_a_trace_without_timestamps_is_refused_before_any_work(tmp_path: Path) -> None:
    (tmp_path / "t.jsonl").write_text('{"hash_ids": [1, 2]}\n')
    ran = kvoffload("replay", tmp_path / "t.jsonl", "--arrivals", "--hints", "none")
    assert ran.code == 2 and ran.out == ""
    assert "no 'timestamp' on every request" in ran.err and ran.err.count("\n") == 1


def test_a_trace_that_names_whole_blocks_only_keeps_its_part_block(tmp_path: Path) -> None:
    """The Claude Code trace gives hash ids to whole 64-token blocks only: a prompt of 150
    tokens has 2 ids and a part block of 22 tokens of its own."""
    trace = load_trace(write_trace(tmp_path / "t.jsonl", [(0, [1, 2], 150)]), block_tokens=64)
    assert len(trace.tokens(0)) == 150 and trace.block_tokens == 64
    with pytest.raises(ConfigError, match=r"from 1 to 191 \(64 per hash id, and a part block\)"):
        load_trace(write_trace(tmp_path / "u.jsonl", [(0, [1, 2], 192)]), block_tokens=64)
