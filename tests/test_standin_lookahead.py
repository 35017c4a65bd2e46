"""An EAGLE-like drafter in the stand-in: KV that reads past each block, served through kvoffload.

With ``KVLayout.lookahead = k`` the stand-in's forward writes a block's final
KV as a function of the tokens up to its end and the ``k`` after it, and only
once the drafter's KV of its last position is final (vLLM's rule: the
request's computed tokens exceed ``p + k - 1``); before that the block holds
other bytes. Its GPU prefix cache hashes blocks with the lookahead (vLLM
0.34's lookahead block hashes) and caches only final blocks. kvoffload's real
scheduler and worker serve it; every load is checked bit-exact against the
final KV. A connector keyed without the lookahead, or storing before the KV
is final, loads other bytes: the negative controls count them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from kvoffload import build_offloading_config
from kvoffload.config.layout import CacheGroup, KVLayout
from kvoffload.errors import ConfigError
from kvoffload.keys import namespace_of
from kvoffload.standin import KVOffloadSide, KVPages, StandIn
from kvoffload.standin._forward import final_tokens
from kvoffload.transfer import allocate_kv_caches

PAGE = 64
NUM_BLOCKS = 400
TPB = 4


def eagle(lookahead: int) -> KVLayout:
    """A target layer and an EAGLE head's layer in one full-attention group, as vLLM forms it."""
    group = CacheGroup("full", TPB, ("model.layers.0.self_attn.attn",
                                     "model.layers.1.self_attn.attn"), PAGE)  # fmt: skip
    return KVLayout((group,), lookahead)


def hybrid(lookahead: int) -> KVLayout:
    """A sliding-window group (8-token blocks, window 12) beside the full group with the head."""
    sliding = CacheGroup("sliding", 8, ("s0",), PAGE, sliding_window=12)
    return KVLayout((sliding, *eagle(lookahead).groups), lookahead)


def tokens(n: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 104729) % 1000 + 1 for i in range(n)]


@dataclass
class Served:
    loaded: int
    gpu_hit: int
    verified: int
    mismatched: int


class Rig:
    """The stand-in over ``engine_layout``; kvoffload's connector configured on ``layout``
    (the same groups; another lookahead makes a negative control)."""

    def __init__(self, engine_layout: KVLayout, layout: KVLayout | None = None, *,
                 step_tokens: int = 64, **extra: Any) -> None:  # fmt: skip
        layout = engine_layout if layout is None else layout
        settings = {"blocks_per_chunk": 1, "cpu_bytes_to_use": "1MiB",
                    "retention_interval": 1, **extra}  # fmt: skip
        self.config = build_offloading_config(settings, layout)
        kv = allocate_kv_caches(engine_layout, NUM_BLOCKS, torch.bfloat16)
        self.side = KVOffloadSide(self.config, namespace_of("stand-in", "bfloat16", layout), kv)
        self.engine = StandIn(engine_layout, self.side, gpu_blocks=NUM_BLOCKS,
                              step_tokens=step_tokens, kv=KVPages(engine_layout, kv))  # fmt: skip

    def serve(self, *requests: tuple[str, Sequence[int], Sequence[int]],
              gpu: bool = False, in_flight: int = 1) -> Served:  # fmt: skip
        """Serve ``(id, prompt, output)`` requests; the GPU cache is reset first unless ``gpu``."""
        if not gpu:
            self.engine.reset_prefix_cache()
        s = self.engine.stats
        before = (s.loaded_tokens, s.gpu_hit_tokens, s.verified_blocks, s.mismatched_blocks)
        self.engine.run(requests, in_flight=in_flight)
        after = (s.loaded_tokens, s.gpu_hit_tokens, s.verified_blocks, s.mismatched_blocks)
        assert s.failed_load_tokens == 0
        return Served(*(a - b for a, b in zip(after, before, strict=True)))


@pytest.fixture
def rigs() -> Iterator[list[Rig]]:
    made: list[Rig] = []
    yield made
    for rig in made:
        rig.side.close()


def expected_hit(prompt: Sequence[int], earlier: Sequence[Sequence[int]], span: int, k: int) -> int:
    """The longest hit of ``prompt`` on chunks of ``span`` tokens that requests of token lists
    ``earlier`` left final: it leaves ``max(1, k)`` prompt tokens, and the ``k`` tokens after
    its last chunk are the earlier request's too."""
    best = 0
    for done in earlier:
        final = final_tokens(k, len(done) - 1 if len(done) > 1 else 1, len(done))
        top = min(final, len(prompt) - max(1, k))
        hit = top // span * span
        while hit and list(prompt[: hit + k]) != list(done[: hit + k]):
            hit -= span
        best = max(best, hit)
    return best


@pytest.mark.parametrize("lookahead", [1, 3])
@pytest.mark.parametrize("bpc", [1, 2])
def test_prompts_diverging_at_a_chunk_boundary_hit_only_what_the_lookahead_names(
    rigs: list[Rig], lookahead: int, bpc: int
) -> None:
    span = TPB * bpc
    rig = Rig(eagle(lookahead), blocks_per_chunk=bpc)
    rigs.append(rig)
    shared = tokens(4 * span)  # ends on a chunk boundary
    first = [*shared, *tokens(9, seed=1)]
    assert rig.serve(("a", first, ())).loaded == 0
    other = [*shared, *tokens(9, seed=2)]  # goes on otherwise right after a chunk
    served = rig.serve(("b", other, ()))
    assert served.loaded == expected_hit(other, [first], span, lookahead) == 3 * span
    assert served.mismatched == 0 and served.verified == 3 * bpc
    same = [*first, *tokens(5, seed=3)]  # goes on as the first did
    served = rig.serve(("c", same, ()))
    assert served.loaded == expected_hit(same, [first, other], span, lookahead)
    assert served.loaded >= 4 * span and served.mismatched == 0


@pytest.mark.parametrize("lookahead", [1, 3])
def test_multi_turn_conversations_hit_their_history_with_chunked_prefill(
    rigs: list[Rig], lookahead: int
) -> None:
    """Small prefill steps (5 tokens: blocks turn final steps after they are computed), a
    decoded output, then the next turn's prompt: its history comes back bit-exact."""
    rig = Rig(eagle(lookahead), step_tokens=5)
    rigs.append(rig)
    history: list[int] = []
    earlier: list[list[int]] = []
    for turn in range(4):
        prompt = [*history, *tokens(7 + 3 * turn, seed=10 + turn)]
        output = tokens(6, seed=20 + turn)
        served = rig.serve((f"t{turn}", prompt, output))
        assert served.loaded == expected_hit(prompt, earlier, TPB, lookahead)
        assert served.mismatched == 0 and served.verified == served.loaded // TPB
        earlier.append([*prompt, *output])
        history = earlier[-1]
    assert rig.engine.stats.loaded_tokens > 0


@pytest.mark.parametrize("lookahead", [1, 3])
def test_the_gpu_cache_hashes_with_the_lookahead_and_caches_only_final_blocks(
    rigs: list[Rig], lookahead: int
) -> None:
    """Concurrent requests share the GPU cache: hits only where the tokens after the block are
    the same, and a block is served only once final (no load checks a GPU hit: a wrong one
    would go unseen, so the hits are held to the reference)."""
    rig = Rig(eagle(lookahead), step_tokens=6)
    rigs.append(rig)
    shared = tokens(24)
    first = [*shared, *tokens(5, seed=1)]
    rig.serve(("a", first, ()))
    second = [*shared, *tokens(5, seed=2)]
    served = rig.serve(("b", second, ()), gpu=True)
    assert served.gpu_hit == expected_hit(second, [first], TPB, lookahead)
    assert served.loaded == 0
    batch = [(f"c{i}", [*first, *tokens(8, seed=30 + i)], tokens(3, seed=40 + i)) for i in range(4)]
    served = rig.serve(*batch, gpu=True, in_flight=4)
    assert served.mismatched == 0 and served.gpu_hit >= 4 * (len(first) - 4 - lookahead)


def test_a_hybrid_layout_with_a_lookahead_serves_its_window_bit_exact(rigs: list[Rig]) -> None:
    rig = Rig(hybrid(1), step_tokens=7)
    rigs.append(rig)
    shared = tokens(48)
    rig.serve(("a", [*shared, *tokens(9, seed=1)], tokens(4, seed=2)))
    served = rig.serve(("b", [*shared, *tokens(9, seed=3)], ()))
    assert served.loaded == 40 and served.mismatched == 0 and served.verified > 0


CONTROLS = [(1, 0, "tokens"), (3, 0, "tokens"), (3, 0, "auto"), (3, 1, "tokens")]


@pytest.mark.parametrize(("engine_k", "connector_k", "source"), CONTROLS)
def test_a_connector_keyed_without_the_lookahead_or_storing_early_loads_wrong_kv(
    rigs: list[Rig], engine_k: int, connector_k: int, source: str
) -> None:
    """Negative controls: the stand-in's drafter reads ``engine_k`` tokens ahead, the connector's
    layout says ``connector_k``. Its loads fill blocks with bytes other than the final KV.

    With token keys and no lookahead the key misses the tokens after the chunk (``b`` loads
    ``a``'s last chunk); engine keys chain the stand-in's lookahead block hashes, so that
    connector (and the one told 1 of 3 tokens) keys right but stores a block before its KV is
    final: only the stand-in's provisional KV shows that.
    """
    rig = Rig(eagle(engine_k), eagle(connector_k), step_tokens=5, key_source=source)
    rigs.append(rig)
    shared = tokens(16)
    rig.serve(("a", [*shared, *tokens(9, seed=1)], tokens(4, seed=5)))
    served = rig.serve(("b", [*shared, *tokens(9, seed=2)], ()))
    assert served.loaded > 0 and served.mismatched > 0


def test_the_same_requests_without_a_lookahead_are_exact_and_hit_every_chunk(
    rigs: list[Rig],
) -> None:
    rig = Rig(eagle(0))
    rigs.append(rig)
    shared = tokens(16)
    rig.serve(("a", [*shared, *tokens(9, seed=1)], ()))
    served = rig.serve(("b", [*shared, *tokens(9, seed=2)], ()))
    assert served.loaded == 16 and served.mismatched == 0


def test_a_lookahead_beside_a_recurrent_group_is_refused() -> None:
    layout = KVLayout(
        (CacheGroup("mamba", 8, ("m0",), 160), CacheGroup("full", 8, ("a0",), PAGE)), 1
    )
    kv = allocate_kv_caches(layout, 16, torch.bfloat16)
    config = build_offloading_config({"cpu_bytes_to_use": "1MiB"}, layout)
    side = KVOffloadSide(config, b"ns", kv)
    try:
        with pytest.raises(ConfigError, match="lookahead of 1 beside recurrent state groups"):
            StandIn(layout, side, gpu_blocks=16, kv=KVPages(layout, kv))
    finally:
        side.close()
