"""The stand-in for vLLM: its GPU prefix cache, its engine loop, and the connector through it.

The prefix cache is checked against vLLM's rules worked by hand (eviction
order, hit alignment, null blocks outside a window). Then kvoffload's own
connector serves requests through the stand-in, real bytes checked
bit-exact, and the index order the product promises is checked on it: a
prompt vLLM's own cache serves counts as a use, and stores go in tail first.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from kvoffload import build_offloading_config
from kvoffload.config.layout import CacheGroup, KVLayout
from kvoffload.errors import ConfigError
from kvoffload.keys import namespace_of, prefix_keys_for_layout
from kvoffload.manager import EventKind
from kvoffload.standin import NULL_BLOCK, KVOffloadSide, KVPages, PrefixCache, StandIn
from kvoffload.transfer import allocate_kv_caches

PAGE = 256
LLAMA = KVLayout((CacheGroup("full", 4, ("l0", "l1"), PAGE),))
GEMMA = KVLayout(
    (
        *(CacheGroup("sliding", 16, (f"s{i}",), PAGE, sliding_window=24) for i in range(3)),
        CacheGroup("full", 4, ("f0",), PAGE),
    )
)
#: Qwen3-Next-like: recurrent-state groups (a state of 160 bytes per 8-token block) and a full one.
QWEN = KVLayout(
    (
        *(CacheGroup("mamba", 8, (f"m{i}",), 160) for i in range(2)),
        CacheGroup("full", 8, ("a0",), PAGE),
    )
)
LAYOUTS = pytest.mark.parametrize("layout", [LLAMA, GEMMA, QWEN], ids=["llama", "gemma", "qwen"])


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 30000) for _ in range(n)]


def hashes(layout: KVLayout, ids: Sequence[int]) -> list[list[bytes]]:
    return prefix_keys_for_layout(ids, layout.tokens_per_block, b"gpu")


# -- the GPU prefix cache ----------------------------------------------------------------------
def test_blocks_are_reused_least_recently_freed_first_and_tails_before_heads() -> None:
    cache = PrefixCache(LLAMA, 9)  # blocks 1..8; 0 is the null block
    a, b = tokens(12, 1), tokens(12, 2)
    ta: list[list[int]] = [[]]
    assert cache.allocate(ta, None, 0, 12)
    cache.cache(ta, hashes(LLAMA, a), 12)
    cache.free(ta)  # a's 3 blocks: tail first into the free queue
    tb: list[list[int]] = [[]]
    assert cache.allocate(tb, None, 0, 12)  # 5 never-used blocks remain: b takes 3 of them
    cache.cache(tb, hashes(LLAMA, b), 12)
    cache.free(tb)
    assert cache.longest_hit(hashes(LLAMA, a), 13)[0] == 12  # a is still cached
    tc: list[list[int]] = [[]]
    assert cache.allocate(tc, None, 0, 12)  # 2 fresh blocks, then a's tail
    assert cache.evictions == 1
    hit, table = cache.longest_hit(hashes(LLAMA, a), 13)
    assert hit == 8 and len(table[0]) == 2  # a's head survives, its tail went first
    assert cache.longest_hit(hashes(LLAMA, b), 13)[0] == 12


def test_a_hit_leaves_a_token_to_compute_and_an_allocation_never_half_happens() -> None:
    cache = PrefixCache(LLAMA, 4)
    a = tokens(12, 3)
    table: list[list[int]] = [[]]
    assert cache.allocate(table, None, 0, 12)
    cache.cache(table, hashes(LLAMA, a), 12)
    assert cache.longest_hit(hashes(LLAMA, a), 12)[0] == 8  # 12 tokens: one must be computed
    more: list[list[int]] = [[]]
    assert not cache.allocate(more, None, 0, 4)  # no free block left
    assert more == [[]] and cache.num_free == 0


def test_hybrid_hits_need_every_full_block_and_only_the_window_of_sliding_groups() -> None:
    cache = PrefixCache(GEMMA, 64)
    ids = tokens(100, 4)
    table: list[list[int]] = [[] for _ in GEMMA.groups]
    assert cache.allocate(table, None, 0, 100)
    cache.cache(table, hashes(GEMMA, ids), 100)
    hit, got = cache.longest_hit(hashes(GEMMA, ids), 100)
    assert hit == 96  # a multiple of 16 and of 4, one token left
    for g in range(3):  # window 24 before 96: tokens [73, 96), i.e. blocks 4 and 5
        assert got[g] == [NULL_BLOCK] * 4 + table[g][4:6]
    assert got[3] == table[3][:24]
    cache.remove_skipped(table, 100)  # sliding blocks before the window go back to the pool
    assert [table[g][:5].count(NULL_BLOCK) for g in range(4)] == [4, 4, 4, 0]
    assert cache.longest_hit(hashes(GEMMA, ids), 100)[0] == 96  # cached while in the queue


def test_without_prefix_caching_nothing_is_cached_or_hit() -> None:
    cache = PrefixCache(GEMMA, 64, caching=False)  # vLLM's enable_prefix_caching=False
    ids = tokens(100, 5)
    table: list[list[int]] = [[] for _ in GEMMA.groups]
    assert cache.allocate(table, None, 0, 100)
    cache.cache(table, hashes(GEMMA, ids), 100)
    assert cache.longest_hit(hashes(GEMMA, ids), 100) == (0, [[], [], [], []])
    cache.free(table)
    assert cache.num_free == 63 and cache.evictions == 0


# -- kvoffload's connector through the stand-in ------------------------------------------------
def make(
    layout: KVLayout,
    tmp_path: Path,
    *,
    cpu_chunks: int,
    gpu_blocks: int,
    step_tokens: int = 64,
    decode_tokens: int = 1,
    prefix_caching: bool = True,
    **extra: object,
) -> tuple[StandIn, KVOffloadSide]:
    slot = max(g.chunk_bytes(1) for g in layout.groups)
    config = build_offloading_config(
        {"cpu_bytes_to_use": cpu_chunks * slot, "blocks_per_chunk": 1, **extra}, layout
    )
    kv = allocate_kv_caches(layout, gpu_blocks)
    side = KVOffloadSide(config, namespace_of("standin-test", "bfloat16", layout), kv)
    pages = KVPages(layout, kv)
    engine = StandIn(layout, side, gpu_blocks=gpu_blocks, step_tokens=step_tokens, kv=pages,
                     decode_tokens=decode_tokens, prefix_caching=prefix_caching)  # fmt: skip
    return engine, side


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Callable[..., tuple[StandIn, KVOffloadSide]]]:
    sides: list[KVOffloadSide] = []

    def build(layout: KVLayout, **kwargs: int) -> tuple[StandIn, KVOffloadSide]:
        engine, side = make(layout, tmp_path, **kwargs)
        sides.append(side)
        return engine, side

    yield build
    for side in sides:
        side.close()


@LAYOUTS
def test_a_side_that_moves_no_bytes_has_no_worker_and_finds_the_same_hits(
    layout: KVLayout,
) -> None:
    # The replay times the scheduler this way (transfers=False), as vLLM's runs beside it.
    slot = max(g.chunk_bytes(1) for g in layout.groups)
    config = build_offloading_config({"cpu_bytes_to_use": 200 * slot}, layout)
    namespace = namespace_of("standin-test", "bfloat16", layout)
    requests = [(f"{r}{i}", tokens(100, 10 + i)) for r in "ab" for i in range(4)]
    found = []
    for transfers in (True, False):
        side = KVOffloadSide(config, namespace, allocate_kv_caches(layout, 48), transfers=transfers)
        assert (side.worker is None) is not transfers
        try:
            stats = StandIn(layout, side, gpu_blocks=48, step_tokens=64).run(requests)
        finally:
            side.close()
        found.append((stats.gpu_hit_tokens, stats.loaded_tokens, side.scheduler.stats()))
    assert found[0] == found[1] and found[0][1] > 0


@LAYOUTS
def test_prompts_evicted_from_the_gpu_come_back_from_the_cpu_bit_exact(
    served: Callable[..., tuple[StandIn, KVOffloadSide]], layout: KVLayout
) -> None:
    # A state group holds one block per request: Qwen's prompts need a smaller GPU cache to
    # be evicted from it.
    engine, side = served(layout, cpu_chunks=200, gpu_blocks=48 if layout is QWEN else 80)
    first = [(f"a{i}", tokens(100, 10 + i)) for i in range(4)]
    again = [(f"b{i}", ids) for i, (_, ids) in enumerate(first)]
    stats = engine.run([*first, *again])  # four prompts do not fit the GPU cache together
    assert stats.requests == 8 and stats.loaded_tokens > 0
    assert stats.verified_blocks > 0 and stats.mismatched_blocks == 0
    assert stats.gpu_hit_tokens + stats.loaded_tokens <= 4 * 96
    figures = side.scheduler.stats()
    assert figures["loaded_tokens"] == stats.loaded_tokens and figures["failed_loads"] == 0
    assert (figures["index_pinned"], figures["index_storing"], figures["jobs_in_flight"]) == (
        0,
        0,
        0,
    )
    side.scheduler.index.check_integrity()


def test_a_prompt_vllms_own_cache_serves_counts_as_a_use(
    served: Callable[..., tuple[StandIn, KVOffloadSide]],
) -> None:
    """A hot prompt stays in the CPU tier while the GPU serves it (issue 15, item 1)."""
    engine, side = served(LLAMA, cpu_chunks=6, gpu_blocks=40, eviction_policy="lru")
    system = tokens(8, 20)  # two chunks
    requests = [("first", system + tokens(5, 21))]  # stores the prompt and one chunk more
    for i in range(3):  # two chunks of its own each, then the prompt alone: a GPU hit
        requests += [(f"u{i}", tokens(9, 30 + i)), (f"s{i}", [*system, 7])]
    stats = engine.run(requests, in_flight=1)
    assert stats.gpu_hit_tokens == 3 * 8 and stats.loaded_tokens == 0
    keys = set(side.scheduler.keys_for(system, block_hashes=engine.request_hashes(system))[0])
    events = side.scheduler.take_events()
    # 3 + 3 * 2 chunks went into 6 slots: 3 were evicted. Had the GPU's hits not been
    # uses, the prompt (stored first, never loaded) would have been the oldest.
    evicted = [e.key for e in events if e.kind is EventKind.REMOVED]
    assert len(evicted) == 3 and not keys & set(evicted)


def test_a_request_is_evicted_tail_first(
    served: Callable[..., tuple[StandIn, KVOffloadSide]],
) -> None:
    engine, side = served(LLAMA, cpu_chunks=4, gpu_blocks=40, eviction_policy="lru")
    a, b = tokens(13, 40), tokens(5, 41)
    engine.run([("a", a), ("b", b)], in_flight=1)  # a stores 3 chunks, b one more...
    engine.run([("c", tokens(5, 42))], in_flight=1)  # ...and c's chunk evicts the oldest
    keys = side.scheduler.keys_for(a, block_hashes=engine.request_hashes(a))[0]
    assert side.scheduler.index.ready_mask(keys) == [True, True, False]


def test_a_recurrent_prompt_runs_in_aligned_steps_and_keeps_the_state_a_hit_needs(
    served: Callable[..., tuple[StandIn, KVOffloadSide]],
) -> None:
    engine, side = served(QWEN, cpu_chunks=200, gpu_blocks=64)
    engine.step_tokens = 20  # not a multiple of the 8-token block
    ids = tokens(100, 7)
    req = engine.add("a", ids)
    ends = []
    while req.computed < len(ids):
        engine.step()
        ends.append(req.computed)
    # vLLM's align mode: prefill steps end on blocks, one at 96 (the last before token 99).
    assert ends == [16, 32, 48, 64, 80, 96, 100]
    engine.step()
    stats = engine.run([("b", ids)])  # vLLM's own cache: the state kept at 96
    assert stats.gpu_hit_tokens == 96 and stats.loaded_tokens == 0
    engine.reset_prefix_cache()
    engine.run([("c", ids)])  # only kvoffload holds it now
    assert stats.loaded_tokens == 96 and stats.mismatched_blocks == 0
    assert stats.verified_blocks == 96 // 8 + 2  # every full block, and each group's state
    figures = side.scheduler.stats()
    assert figures["failed_loads"] == 0 and figures["unretained_chunks"] > 0
    side.scheduler.index.check_integrity()


def test_the_stand_in_refuses_steps_shorter_than_a_state_block(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="step_tokens=4 is below"):
        make(QWEN, tmp_path, cpu_chunks=8, gpu_blocks=16, step_tokens=4)


# -- requests that generate output ------------------------------------------------------------
def test_output_is_decoded_a_token_a_step_and_the_next_turn_hits_at_its_end(
    served: Callable[..., tuple[StandIn, KVOffloadSide]],
) -> None:
    """vLLM decodes after the prompt and never computes the last token it samples; with its
    own prefix cache off, the next turn (prompt, output, new tokens) is served by kvoffload
    from the output's end, bit-exact."""
    engine, side = served(GEMMA, cpu_chunks=400, gpu_blocks=120, prefix_caching=False,
                          retention_interval=0)  # fmt: skip
    prompt, output = tokens(100, 50), tokens(61, 51)
    req = engine.add("a", prompt, output=output)
    ends = []
    while req.computed < req.last:
        engine.step()
        ends.append(req.computed)
    assert ends == [64, 100, *range(101, 161)]  # the prompt in 64-token steps, then a token each
    assert req.last == 160 and engine.stats.prompt_tokens == 100
    engine.step()
    nxt = [*prompt, *output, *tokens(20, 52)]
    stats = engine.run([("b", nxt)], in_flight=1)
    assert stats.gpu_hit_tokens == 0  # no prefix caching: nothing reused on the GPU
    assert stats.loaded_tokens == 160 and stats.mismatched_blocks == 0  # the output's end
    assert stats.verified_blocks > 0 and side.scheduler.stats()["dropped_chunks"] > 0


def test_decode_steps_free_window_blocks_as_vllm_does(
    served: Callable[..., tuple[StandIn, KVOffloadSide]],
) -> None:
    """vLLM frees a sliding group's blocks once the window of the token it computes has left
    them (window 24, 16-token blocks); full-attention blocks stay."""
    engine, _ = served(GEMMA, cpu_chunks=400, gpu_blocks=120)
    req = engine.add("a", tokens(40, 53), output=tokens(70, 54))
    engine.step()  # the prompt
    freed = 0
    while req.computed < req.last - 1:
        first = (req.computed - 23) // 16  # the window of token ``computed`` starts in it
        engine.step()
        for g in range(3):
            assert req.blocks[g][:first] == [NULL_BLOCK] * first
            assert NULL_BLOCK not in req.blocks[g][first:]
        assert NULL_BLOCK not in req.blocks[3]
        freed = first
    assert freed == (108 - 23) // 16


def test_coarse_decode_steps_store_what_one_token_steps_store(tmp_path: Path) -> None:
    """``decode_tokens`` a divisor of every chunk span (4 and 16 tokens here): the same
    chunks stored, dropped, evicted and loaded, under pressure, in fewer steps."""
    kept, steps = [], []
    for i, decode in enumerate((1, 4)):
        engine, side = make(GEMMA, tmp_path / str(i), cpu_chunks=60, gpu_blocks=300,
                            decode_tokens=decode, prefix_caching=False)  # fmt: skip
        turns = [tokens(70, 60)]
        for t in range(5):
            turns.append([*turns[-1], *tokens(40 + 7 * t, 61 + t), *tokens(30, 70 + t)])
        engine.run(
            [(f"r{t}", ids[: len(ids) - 40 - 7 * t], ids[len(ids) - 40 - 7 * t :])
             for t, ids in enumerate(turns)], in_flight=1)  # fmt: skip
        figures = side.scheduler.stats()
        index = side.scheduler.index
        everything = prefix_keys_for_layout(turns[-1], [16, 16, 16, 4], side.scheduler.namespace)
        kept.append(([index.ready_mask(keys) for keys in everything],
                     figures["stored_chunks"], figures["dropped_chunks"],
                     figures["index_evictions"], engine.stats.loaded_tokens))  # fmt: skip
        steps.append(engine.stats.steps)
        side.close()
    assert kept[0] == kept[1] and kept[0][2] > 0 and kept[0][3] > 0
    assert steps[1] < steps[0] / 2


def test_the_stand_in_refuses_decode_steps_of_no_tokens(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="decode_tokens=0"):
        make(GEMMA, tmp_path, cpu_chunks=8, gpu_blocks=16, decode_tokens=0)
