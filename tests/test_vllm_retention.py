"""What retention stores (window chunks and states only for hit points), and the state rule.

Driven through the real ``OffloadScheduler`` and ``OffloadWorker`` by the
stand-in of :mod:`test_vllm_plan` (real index, engines, KV tensors, disk
files; KV as a function of the token prefix, a recurrent block holding the
state after the last token its step computed), with prompts followed by
generated tokens decoded one step at a time, as vLLM does.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from _stand import (
    GEMMA,
    QWEN,
    STATE,
    Model,
    Req,
    Stand,
    block_hashes,
    make_tokens,
    page,
)  # fmt: skip

from kvoffload import build_offloading_config
from kvoffload.config.layout import CacheGroup, KVLayout
from kvoffload.connector._hits import needed_chunks
from kvoffload.errors import ConfigError
from kvoffload.standin import NULL_BLOCK

SLIDING = [0, 1, 2]  # GEMMA's sliding groups: 16-token blocks, window 24, 32-token chunks
GEMMA_FULL = 3
GEMMA_ALIGN = 32
QWEN_ALIGN = 8


def turn(s: Stand, req_id: str, prompt: list[int], generated: int, local: int = 0) -> Req:
    """One request: lookup on the prompt, its load, prefill, ``generated`` tokens decoded.

    vLLM computes every token but the last generated one.
    """
    req = s.ask(req_id, prompt, local)
    req.tokens = prompt + make_tokens(hash(req_id) % 1000, generated)
    req.hashes = block_hashes(s.layout, req.tokens)  # the KV of generated tokens too
    req.prompt_len = len(prompt)
    s.allocate(req)
    if req.load is not None:
        out = s.step()
        s.check_load(req, out)
        s.recover(req, out)
    while req.computed < len(prompt):
        s.step([req], until=len(prompt))
    while req.computed < len(req.tokens) - 1:
        s.step([req], until=req.computed + 1)
    s.finish(req)
    return req


def stored(s: Stand, tokens: list[int], g: int) -> set[int]:
    """Indices of group ``g``'s chunks of ``tokens`` in the CPU tier."""
    keys = s.keys(tokens)[g]
    return {c for c, ready in enumerate(s.ready(keys)) if ready}


def window_chunks(point: int) -> set[int]:
    return set(needed_chunks(GEMMA.layout.groups[0], GEMMA_ALIGN, 0, point))


# -- window chunks ----------------------------------------------------------------------------
def test_window_chunks_are_kept_only_for_the_ends_of_prompt_and_output(
    stand: Callable[..., Stand],
) -> None:
    s = stand(GEMMA, retention_interval=0)
    prompt = make_tokens(1, 200)
    a = turn(s, "a", prompt, 61)  # computes 260 tokens
    prompt_end, output_end = 192, 256
    for g in SLIDING:
        assert stored(s, a.tokens, g) == window_chunks(prompt_end) | window_chunks(output_end)
    assert stored(s, a.tokens, GEMMA_FULL) == set(range(260 // 8))  # every full chunk
    fig = s.scheduler.stats()
    # The trailing point passed 224 on its way: its window chunk was stored, then dropped.
    assert fig["dropped_chunks"] == len(SLIDING) * len(window_chunks(224) - window_chunks(256))
    assert fig["unretained_chunks"] > 0
    assert s.index.stats().ready == sum(len(stored(s, a.tokens, g)) for g in range(4))

    # The next turn of the conversation hits at the output's end, bit-exact.
    b = turn(s, "b", a.tokens + make_tokens(2, 20), 1)
    assert b.offered == output_end and b.verified > 0
    s.check_integrity()


def test_every_chunk_is_kept_with_retention_interval_1(stand: Callable[..., Stand]) -> None:
    s = stand(GEMMA, retention_interval=1)
    a = turn(s, "a", make_tokens(1, 200), 61)
    for g in SLIDING:
        assert stored(s, a.tokens, g) == set(range(260 // GEMMA_ALIGN))
    assert s.scheduler.stats()["dropped_chunks"] == 0


def test_periodic_points_serve_a_prompt_that_diverges(stand: Callable[..., Stand]) -> None:
    s = stand(GEMMA, retention_interval=60)  # rounded up to 64, a multiple of 32
    prompt = make_tokens(3, 200)
    turn(s, "a", prompt, 1)
    for g in SLIDING:
        assert stored(s, prompt, g) == window_chunks(64) | window_chunks(128) | window_chunks(192)
    other = prompt[:150] + make_tokens(4, 60)
    b = turn(s, "b", other, 1)
    assert b.offered == 128 and b.verified > 0


def test_the_junction_with_stored_history_is_kept_for_the_next_prompt(
    stand: Callable[..., Stand],
) -> None:
    s = stand(GEMMA, retention_interval=0)
    prompt = make_tokens(5, 200)
    turn(s, "a", prompt, 1)  # window chunks at 192 only
    b = turn(s, "b", prompt[:150] + make_tokens(6, 50), 1)
    assert b.offered == 0  # its prefix diverges before any point a kept
    # b kept the window where its prefix left a's chunks: 144, aligned down to 128.
    for g in SLIDING:
        assert window_chunks(128) <= stored(s, prompt, g)
    c = turn(s, "c", prompt[:140] + make_tokens(7, 50), 1)
    assert c.offered == 128 and c.verified > 0
    s.check_integrity()


def test_a_fresh_process_finds_the_output_end_on_disk(
    stand: Callable[..., Stand], tmp_path: Path
) -> None:
    """The lower tier is asked about the sparse hit points, not about every chunk."""
    a = stand(GEMMA, disk=True, retention_interval=0)
    first = turn(a, "a", make_tokens(8, 200), 61)
    a.close()
    b = stand(GEMMA, disk=True, probe=True, retention_interval=0)
    follow = first.tokens + make_tokens(9, 100)  # top 352: three candidates have no window
    req = turn(b, "b", follow, 1)
    assert req.offered == 256 and req.verified > 0
    assert b.scheduler.stats()["lower_hit_chunks"] > 0


# -- recurrent states -------------------------------------------------------------------------
def test_states_are_kept_where_steps_ended_at_hit_points(stand: Callable[..., Stand]) -> None:
    s = stand(QWEN, retention_interval=0)
    a = turn(s, "a", make_tokens(10, 100), 30)  # prefill stops at 96 (vLLM), computes 129
    for g in range(3):  # the state at the prompt's end and at the output's end
        assert stored(s, a.tokens, g) == {96 // QWEN_ALIGN - 1, 128 // QWEN_ALIGN - 1}
    assert stored(s, a.tokens, 3) == set(range(128 // QWEN_ALIGN))
    # The trailing point's states at 104, 112 and 120 were stored, then dropped.
    assert s.scheduler.stats()["dropped_chunks"] == 3 * 3

    b = turn(s, "b", a.tokens + make_tokens(11, 20), 1)
    assert b.offered == 128 and b.verified > 0
    # Full-attention chunks reach 120, but a state exists only at 96 below it.
    c = turn(s, "c", a.tokens[:121] + make_tokens(12, 30), 1)
    assert c.offered == 96 and c.verified > 0
    s.check_integrity()


def test_a_state_goes_into_the_block_that_ends_at_the_hit(stand: Callable[..., Stand]) -> None:
    s = stand(QWEN)
    prompt = make_tokens(13, 100)
    turn(s, "a", prompt, 1)
    b = s.admit("b", prompt)
    assert b.hit == 96 and b.load is not None
    state_spans = [span for span in b.load.spans if span.group < 3]
    for span in state_spans:
        assert span.blocks.block_ids == (b.blocks[span.group][96 // 8 - 1],)
        assert span.blocks.first_offset == 0
    assert {span.group for span in state_spans} == {0, 1, 2}
    out = s.step()
    s.check_load(b, out)
    assert b.verified == 3 + 96 // 8  # three states and the full-attention blocks


def test_states_with_two_blocks_per_chunk(stand: Callable[..., Stand]) -> None:
    model = Model("qwen-bpc2", QWEN.layout, bpc=2)
    s = stand(model, retention_interval=0)
    prompt = make_tokens(14, 100)  # vLLM stops the prefill at 96, a multiple of 16
    turn(s, "a", prompt, 1)
    assert s.scheduler.config.chunk_bytes[0] == STATE  # one state per chunk
    b = s.admit("b", prompt)
    assert b.hit == 96
    out = s.step()
    s.check_load(b, out)
    assert b.verified == 3 + 96 // 8


def test_a_null_state_block_fails_the_load(stand: Callable[..., Stand]) -> None:
    s = stand(QWEN)
    prompt = make_tokens(15, 100)
    turn(s, "a", prompt, 1)
    b = s.ask("b", prompt)
    b.blocks = s.alloc(len(prompt))
    b.blocks[1][96 // 8 - 1] = NULL_BLOCK  # no block to restore group 1's state into
    order = s.scheduler.plan_load("b", b.blocks, b.offered or 0)
    assert order is not None and order.unloadable == {1: (NULL_BLOCK,)}
    out = s.step()
    assert out.failed_recving == {"b"}


def test_a_missing_state_chunk_fails_the_load_by_request(
    stand: Callable[..., Stand], tmp_path: Path
) -> None:
    a = stand(QWEN, disk=True)
    prompt = make_tokens(16, 100)
    turn(a, "a", prompt, 1)
    state_key = a.keys(prompt)[2][96 // 8 - 1]
    a.close()
    b = stand(QWEN, disk=True, probe=True)
    req = b.admit("b", prompt)
    assert req.hit == 96
    [path] = (tmp_path / "disk").rglob(f"{state_key.hex()}.kv")
    path.unlink()  # gone between the lookup and the load
    out = b.step()
    assert out.failed_recving == {"b"}
    b.check_load(req, out)  # what was loaded is exact, the state block was never written
    state_block = req.blocks[2][96 // 8 - 1]
    assert b.block_state(req, 2, 96 // 8 - 1) == "scrub", state_block
    fig = b.scheduler.stats()
    assert (fig["failed_loads"], fig["loaded_tokens"]) == (1, 0)
    # Recomputed by vLLM, stored again; the next request is served whole.
    b.recover(req, out)
    while req.computed < len(prompt):
        b.step([req])
    b.finish(req)
    again = b.admit("c", prompt)
    assert again.hit == 96
    b.check_load(again, b.step())
    assert again.verified == 3 + 96 // 8
    b.check_integrity()


def test_state_pages_move_without_their_padding(stand: Callable[..., Stand]) -> None:
    s = stand(QWEN)
    prompt = make_tokens(17, 100)
    a = s.admit("a", prompt)
    layer = "m0"
    tensor = s.kv[0][layer]
    assert tensor.dtype.itemsize == 1 and tensor.stride(0) > STATE  # vLLM's padded int8 view
    block = a.blocks[0][96 // 8 - 1]
    padding = tensor.as_strided((tensor.shape[0], tensor.stride(0) - STATE), (tensor.stride(0), 1),
                                STATE)[block]  # fmt: skip
    padding.fill_(7)
    while a.computed < len(prompt):
        s.step([a])
    s.finish(a)
    b = s.admit("b", prompt)
    s.step()
    assert bool((padding == 7).all())  # the load wrote the state, not the bytes after it
    assert page(s.kv[0], layer, b.blocks[0][96 // 8 - 1]).numel() == STATE


# -- configuration ----------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [-1, True, 2.5, "x"])
def test_retention_interval_is_checked(bad: object) -> None:
    with pytest.raises(ConfigError, match="retention_interval"):
        build_offloading_config({"cpu_bytes_to_use": "1MiB", "retention_interval": bad},
                                GEMMA.layout)  # fmt: skip


def test_retention_interval_rounds_up_to_a_hit_point() -> None:
    layout = KVLayout((CacheGroup("sliding", 16, ("s",), 64, sliding_window=24),
                       CacheGroup("full", 4, ("f",), 64)))  # fmt: skip
    config = build_offloading_config(
        {"cpu_bytes_to_use": "1MiB", "blocks_per_chunk": 2, "retention_interval": 40}, layout
    )
    assert (config.hit_alignment, config.retention_step) == (32, 64)
    assert "every 64 tokens" in str(config)
    off = build_offloading_config({"cpu_bytes_to_use": "1MiB", "retention_interval": 0}, layout)
    assert off.retention_step == 0
