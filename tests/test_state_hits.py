"""Issue 29's lost hit, through the stand-in: recurrent state groups at two blocks per chunk.

vLLM keeps a recurrent state only where a prefill step ended (align mode). A
prompt computed in one step has one at its last block boundary before its
last token. The issue's prompts (1300 shared tokens, 256-token blocks) end their
shared boundary at 1280 tokens, five blocks: inside the third 512-token chunk.
The first prompt, which computes the prefix, got no hit from the connector
after the reset (the two sharing it got theirs from the engine's own cache,
which the first refilled in the same step). Now each prompt stores a *tail*
there (the attention part-chunk and the states at 1280, under keys of their own:
``kvoffload.connector._tails``) and every prompt gets 1280 tokens from the
connector, as at one block per chunk. The connector still says at start what
tails do not cover.
"""

from __future__ import annotations

import functools
import json
import logging
import random
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from _stand import QWEN as STAND_QWEN
from _stand import Model, Stand, make_tokens

from kvoffload import build_offloading_config
from kvoffload.cli import main
from kvoffload.config.layout import CacheGroup, KVLayout
from kvoffload.connector._tails import Tails, whole_chunks
from kvoffload.connector.scheduler import OffloadScheduler
from kvoffload.keys import EngineHashes, namespace_of, prefix_keys, tail_key
from kvoffload.messages import BlockSpan, ChunkSpan
from kvoffload.standin import KVOffloadSide, KVPages, StandIn
from kvoffload.tiers.disk import DiskProbe
from kvoffload.transfer import allocate_kv_caches

BLOCK = 256
#: Qwen3-Next on vLLM's CPU backend (AVX2): three gated-DeltaNet groups, one full-attention
#: group, one block size.
QWEN = KVLayout(
    (
        *(CacheGroup("mamba", BLOCK, (f"m{i}",), 160) for i in range(3)),
        CacheGroup("full", BLOCK, ("a0",), 4 * BLOCK),
    )
)


def issue_prompts() -> list[list[int]]:
    """Three prompts sharing 1300 tokens (tails of 70, 93, 116), then an unrelated one."""
    rng = random.Random(29)
    prefix = [rng.randrange(1, 512) for _ in range(1300)]
    shared = [prefix + [rng.randrange(1, 512) for _ in range(tail)] for tail in (70, 93, 116)]
    return [*shared, [rng.randrange(1, 512) for _ in range(1300)]]


def run_passes(
    blocks_per_chunk: int,
    passes: list[list[list[int]]],
    output: Sequence[int] = (7,) * 8,
    **extra: object,
) -> list[list[tuple[int, int]]]:
    """(engine's own hit, connector's hit) of each prompt of each pass: the passes run one
    after the other in one stand-in engine, its GPU prefix cache reset before each; each
    prompt generates ``output``.

    ``extra`` goes into the connector's configuration; with a ``disk_path``, each pass
    runs in a fresh engine and connector (a restart) whose lookups probe that disk tier."""
    config = build_offloading_config(
        {"cpu_bytes_to_use": 256 << 20, "blocks_per_chunk": blocks_per_chunk, **extra}, QWEN
    )
    namespace = namespace_of("issue-29", "bfloat16", QWEN)
    kv = allocate_kv_caches(QWEN, 200)
    disk = config.disk_path
    out: list[list[tuple[int, int]]] = []
    side: KVOffloadSide | None = None
    engine: StandIn | None = None
    try:
        for n, prompts in enumerate(passes):
            if engine is None or disk is not None:
                if side is not None:
                    side.close()
                probes = [DiskProbe(Path(disk), namespace)] if disk is not None else []
                side = KVOffloadSide(config, namespace, kv, probes)
                engine = StandIn(QWEN, side, gpu_blocks=200, step_tokens=4096,
                                 kv=KVPages(QWEN, kv))  # fmt: skip
            else:
                engine.reset_prefix_cache()
            requests = [engine.add(f"{n}-{i}", p, output=output) for i, p in enumerate(prompts)]
            while engine.waiting or engine.running:
                engine.step()
            engine.step()
            assert engine.stats.mismatched_blocks == 0
            out.append([(r.local_hit, r.external) for r in requests])
    finally:
        if side is not None:
            side.close()
    return out


def second_pass(blocks_per_chunk: int, **extra: object) -> list[tuple[int, int]]:
    """(engine's own hit, connector's hit) of each prompt, the second time, after a reset."""
    return run_passes(blocks_per_chunk, [issue_prompts()] * 2, **extra)[1]


def test_one_block_per_chunk_serves_every_state_vllm_keeps(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvoffload"):
        assert second_pass(1) == [(0, 1280)] * 4
    assert not [r for r in caplog.records if "blocks_per_chunk" in r.getMessage()]


def test_two_blocks_per_chunk_serve_the_state_inside_a_chunk_from_a_tail(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvoffload"):
        assert second_pass(2) == [(0, 1280)] * 4
    [warning] = [r.getMessage() for r in caplog.records if "blocks_per_chunk" in r.getMessage()]
    assert warning.startswith(
        "blocks_per_chunk=2 with recurrent state groups: a hit needs a state taken on a "
        "multiple of 512 tokens, or at a 256-token block boundary where a prompt or a "
        "decoded output ends (stored as a tail)"
    )
    assert warning.endswith("set blocks_per_chunk to 1 to serve every state vLLM keeps")


@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_plan_says_so_before_the_engine_starts(
    blocks_per_chunk: int, capsys: pytest.CaptureFixture[str]
) -> None:
    config = json.dumps({"cpu_bytes_to_use": "1GiB", "blocks_per_chunk": blocks_per_chunk})
    args = ["plan", "tiny_qwen3_next", "--block-size", "128", "--extra-config", config]
    assert main(args) == 0
    note = "Note: blocks_per_chunk=2 with recurrent state groups: a hit needs a state taken on"
    assert (note in capsys.readouterr().out) is (blocks_per_chunk == 2)


@pytest.mark.parametrize("key_source", ["tokens", "engine"])
def test_tails_hit_with_either_key_source(key_source: str) -> None:
    assert second_pass(2, key_source=key_source) == [(0, 1280)] * 4


def test_a_tail_serves_another_prompt_through_the_same_boundary() -> None:
    """A prompt sharing the first 1300 tokens but longer (its own last boundary at 1792, a
    tail it has not stored) hits the first prompt's tail at 1280, as vLLM's own cache
    hits its state there; one sharing only 1100 tokens does not (the tail's key covers
    the tokens up to 1280), nor does vLLM's cache."""
    first, *_, unrelated = issue_prompts()
    rng = random.Random(7)
    longer = first[:1300] + [rng.randrange(1, 512) for _ in range(500)]
    shorter = first[:1100] + [rng.randrange(1, 512) for _ in range(300)]
    passes = run_passes(2, [[first], [longer, shorter, unrelated]])
    assert passes == [[(0, 0)], [(0, 1280), (0, 0), (0, 0)]]


def test_a_fresh_process_finds_the_tail_on_disk(tmp_path: Path) -> None:
    """A restart's lookups probe the disk tier for the tail chunks and states, and load
    them into fresh CPU slots."""
    disk = {"disk_path": str(tmp_path / "kv"), "disk_bytes_to_use": 256 << 20}
    first, *_ = issue_prompts()
    assert run_passes(2, [[first], [first]], **disk) == [[(0, 0)], [(0, 1280)]]


def test_tails_only_where_a_chunk_cuts_a_state_of_a_recurrent_hybrid() -> None:
    """Every other layout keeps its keys and hits: no tail anywhere."""
    full = CacheGroup("full", BLOCK, ("a0",), 4 * BLOCK)
    window = CacheGroup("sliding", BLOCK, ("s0",), 4 * BLOCK, sliding_window=512)
    mamba = CacheGroup("mamba", BLOCK, ("m0",), 160)
    small = CacheGroup("full", BLOCK // 2, ("a1",), 4 * BLOCK)
    for layout, bpc, on in [
        (QWEN, 2, True),
        (QWEN, 4, True),
        (QWEN, 1, False),
        (KVLayout((full,)), 2, False),
        (KVLayout((window, full)), 2, False),
        (KVLayout((mamba, window, full)), 2, False),
        (KVLayout((mamba, small)), 2, False),
    ]:
        config = build_offloading_config(
            {"cpu_bytes_to_use": 64 << 20, "blocks_per_chunk": bpc}, layout
        )
        assert bool(Tails(config, b"ns")) is on, (layout, bpc)


def test_tail_points_and_candidates() -> None:
    config = build_offloading_config({"cpu_bytes_to_use": 64 << 20, "blocks_per_chunk": 4}, QWEN)
    tails = Tails(config, b"ns")
    assert [tails.is_tail(t) for t in (0, 256, 512, 768, 1024, 1100)] == [
        False, True, True, True, False, False,
    ]  # fmt: skip
    # The boundaries inside the chunk the chain stops in, best first, up to the prompt's.
    assert tails.candidates(top=5000, cap=1024, above=0) == [1792, 1536, 1280]
    assert tails.candidates(top=1600, cap=1024, above=0) == [1536, 1280]
    assert tails.candidates(top=5000, cap=1024, above=1536) == [1792]
    assert tails.candidates(top=1024, cap=1024, above=0) == []


def test_tail_keys_name_their_tokens_and_never_a_chunk() -> None:
    rng = random.Random(3)
    tokens = [rng.randrange(1, 512) for _ in range(1400)]
    keys = prefix_keys(tokens, 512, 3, b"ns")
    at = functools.partial(tail_key, keys[:2], tokens, 512, 3, b"ns")
    key = at(stop=1280)
    assert key == tail_key(keys[:2], [*tokens[:1280], 9, 9], 512, 3, b"ns", stop=1280)
    assert key not in keys and key != at(stop=1279) and key != at(stop=1281)
    group_2 = prefix_keys(tokens, 512, 2, b"ns")[:2]  # the chain carries group and namespace
    assert key != tail_key(group_2, tokens, 512, 2, b"ns", stop=1280)
    other = [*tokens[:1100], *(t % 511 + 1 for t in tokens[1100:])]
    assert key != tail_key(keys[:2], other, 512, 3, b"ns", stop=1280)
    assert tail_key([], tokens, 512, 3, b"ns", stop=256) != tail_key(
        [], tokens, 512, 3, b"other", stop=256
    )
    with pytest.raises(ValueError, match="must end inside it"):
        at(stop=1536)
    engine = EngineHashes(256, "sha256")
    hashes = [bytes([i]) * 16 for i in range(5)]
    by_engine = functools.partial(at, engine=engine, stop=1280)
    assert by_engine(block_hashes=hashes[:4]) is None  # the engine has not hashed 1280 yet
    assert by_engine(block_hashes=hashes) not in (None, key)


def tail_scheduler() -> tuple[OffloadScheduler, list[int], list[list[bytes]], list[bytes]]:
    """A scheduler over QWEN at two blocks per chunk, the issue's first prompt, the keys of
    its two full chunks per group, and its tail keys at 1280 (group by group)."""
    config = build_offloading_config({"cpu_bytes_to_use": 64 << 20, "blocks_per_chunk": 2}, QWEN)
    scheduler = OffloadScheduler(config, b"ns")
    prompt = issue_prompts()[0]
    keys = [group_keys[:2] for group_keys in scheduler.keys_for(prompt)]
    tails = [tail_key(k, prompt, 512, g, b"ns", stop=1280) for g, k in enumerate(keys)]
    return scheduler, prompt, keys, [t for t in tails if t is not None]


def stored(scheduler: OffloadScheduler, keys: list[bytes], *, complete: bool = True) -> None:
    assert scheduler.index.prepare_store(keys) is not None
    if complete:
        scheduler.index.complete_store(keys)


def test_a_tail_hit_needs_the_chain_below_it_and_every_groups_tail() -> None:
    """The hit rule at a tail: the full-attention chunks before it, its part-chunk and
    every state group's state there; a piece being stored defers the lookup."""
    scheduler, prompt, keys, tails = tail_scheduler()
    chain = keys[3]  # the full-attention group's chunks; the states at 512, 1024 never were
    stored(scheduler, chain)
    for missing in range(4):  # any one piece missing: no hit at all (none at 1024 either)
        stored(scheduler, tails[:missing] + tails[missing + 1 :])
        assert scheduler.lookup(f"miss-{missing}", prompt, 0) == 0
        scheduler.index.discard(tails)
    stored(scheduler, tails)
    assert scheduler.lookup("whole", prompt, 0) == 1280
    assert scheduler.lookup("engine's own", prompt, 1024) == 256  # the rest is the tail
    scheduler.index.discard(chain[1:])
    assert scheduler.lookup("chain cut", prompt, 0) == 0
    assert scheduler.lookup("chain cut below the engine's", prompt, 1024) == 256


def test_a_tail_being_stored_defers_the_lookup() -> None:
    scheduler, prompt, keys, tails = tail_scheduler()
    stored(scheduler, keys[3] + tails[:3])
    stored(scheduler, tails[3:], complete=False)
    assert scheduler.lookup("wait", prompt, 0) is None
    scheduler.index.complete_store(tails[3:])
    assert scheduler.lookup("now", prompt, 0) == 1280


def test_tails_are_never_told_to_a_router_as_the_engines_blocks() -> None:
    """KV events describe a stored or promoted chunk as the engine's blocks of that chunk: a
    tail is not one (its slot's padding repeats its last block; its load ends inside it)."""
    keys, slots = (b"a", b"b", b"t"), (0, 1, 2)
    store = ChunkSpan(3, keys, slots, BlockSpan((5, 6, 7, 8, 9, 9)))
    assert whole_chunks(store, 2) == [True, True, False]
    load = ChunkSpan(3, keys, slots, BlockSpan((6, 7, 8, 9), first_offset=1))
    assert whole_chunks(load, 2) == [True, True, False]
    assert whole_chunks(ChunkSpan(3, keys[:2], slots[:2], BlockSpan((6, 7, 8), 1)), 2) == [
        True, True,
    ]  # fmt: skip
    assert whole_chunks(ChunkSpan(0, keys, slots, BlockSpan((4, 4, 4))), 1) == [True] * 3


def test_a_next_turn_resumes_at_the_outputs_last_block_boundary() -> None:
    """A conversation's second turn (the first's prompt and 500-token output, then more)
    resumes where the first turn's KV ends, 1792 tokens: a block boundary a 512-token
    chunk cuts. The first turn's trailing point moved block by block while it decoded,
    storing a tail at each odd block and dropping the one before; its last stayed."""
    rng = random.Random(5)
    prompt = [rng.randrange(1, 512) for _ in range(1300)]
    output = [rng.randrange(1, 512) for _ in range(500)]
    turns = [[prompt], [[*prompt, *output, *(rng.randrange(1, 512) for _ in range(40))]]]
    assert run_passes(1, turns, output)[1] == [(0, 1792)]
    assert run_passes(2, turns, output)[1] == [(0, 1792)]


#: The connector core's harness model of a recurrent hybrid (8-token blocks), at two
#: blocks per chunk: 16-token chunks, so a 45-token prompt's state at 40 is a tail.
QWEN_TAILS = Model("qwen-tails", STAND_QWEN.layout, bpc=2)


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("disk", [False, True])
def test_a_tail_round_trip_on_every_rank(
    stand: Callable[..., Stand], world_size: int, disk: bool
) -> None:
    """Stored by one request, the tail serves the next: the order covers exactly the blocks
    the hit needs (the harness checks), every rank loads them bit-exact, and a restart's
    lookup finds them on disk."""
    s = stand(QWEN_TAILS, world_size=world_size, disk=disk)
    tokens = make_tokens(29, 45)
    first, _ = s.serve("a", tokens)
    assert first.offered == 0
    second, out = s.serve("b", tokens)
    assert second.hit == 40 and second.verified == sum(map(len, second.load_ids.values())) > 0
    assert out.failed_blocks == set() and out.failed_recving == set()
    longer, _ = s.serve("c", [*tokens[:41], *make_tokens(30, 30)])  # the same tokens to 40
    assert longer.hit == 40 and longer.verified > 0
    s.check_integrity()
    if disk:
        fresh = stand(QWEN_TAILS, world_size=world_size, disk=True, probe=True)
        third, _ = fresh.serve("d", tokens)
        assert third.hit == 40 and third.verified > 0
        # Two attention chunks, the part-chunk and three states, all from the disk.
        assert fresh.scheduler.stats()["lower_hit_chunks"] == 6
        fresh.check_integrity()


def test_trailing_tails_are_dropped_as_the_output_moves_on(stand: Callable[..., Stand]) -> None:
    """Decoding one token a step, a request trails its output's end block by block (8-token
    blocks, 16-token chunks): a tail at each odd block, the states alone at each chunk end,
    the previous one dropped from the index; the last stays for the next turn."""
    s = stand(QWEN_TAILS, retention_interval=0)  # no periodic points: trailing ones only
    prompt, output = make_tokens(31, 45), make_tokens(32, 30)
    req = s.ask("a", [*prompt, *output])
    req.prompt_len = len(prompt)
    s.allocate(req)
    while req.computed < len(req.tokens):
        s.step([req], until=max(len(prompt), req.computed + 1))
    s.finish(req)
    s.check_integrity()
    fig = s.scheduler.stats()
    # Dropped: the states at 48 and 64 and the tail at 56 (a part-chunk and three states).
    assert fig["dropped_chunks"] == 3 + 4 + 3
    # Left: the four full attention chunks, the prompt's tail at 40 and the output's at 72.
    assert fig["index_ready"] == 4 + 4 + 4
    more = [*prompt, *output, *make_tokens(33, 10)]
    second, out = s.serve("b", more)
    assert second.hit == 72 and second.verified > 0 and out.failed_recving == set()
    s.check_integrity()
