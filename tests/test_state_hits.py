"""Issue 29's lost hit, through the stand-in: recurrent state groups at two blocks per chunk.

vLLM keeps a recurrent state only where a prefill step ended (align mode). A
prompt computed in one step has one at its last block boundary before its
last token; at ``blocks_per_chunk`` 2 a hit needs that boundary on a chunk
end. The issue's prompts (1300 shared tokens, 256-token blocks) end their
shared boundary at 1280 tokens, five blocks: no chunk end. So the first
prompt, which computes the prefix, gets no hit from the connector after the
reset, and the two sharing it get theirs from the engine's own cache, which
the first refilled in the same step; at one block per chunk every prompt
gets 1280 tokens from the connector. The connector says so at start.
"""

from __future__ import annotations

import json
import logging
import random

import pytest

from kvoffload import build_offloading_config
from kvoffload.cli import main
from kvoffload.config.layout import CacheGroup, KVLayout
from kvoffload.keys import namespace_of
from kvoffload.standin import KVOffloadSide, KVPages, StandIn
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


def second_pass(blocks_per_chunk: int) -> list[tuple[int, int]]:
    """(engine's own hit, connector's hit) of each prompt, the second time, after a reset."""
    config = build_offloading_config(
        {"cpu_bytes_to_use": 256 << 20, "blocks_per_chunk": blocks_per_chunk}, QWEN
    )
    kv = allocate_kv_caches(QWEN, 200)
    side = KVOffloadSide(config, namespace_of("issue-29", "bfloat16", QWEN), kv)
    engine = StandIn(QWEN, side, gpu_blocks=200, step_tokens=4096, kv=KVPages(QWEN, kv))
    try:
        for n in range(2):
            requests = [engine.add(f"{n}-{i}", p, output=[7] * 8)
                        for i, p in enumerate(issue_prompts())]  # fmt: skip
            while engine.waiting or engine.running:
                engine.step()
            engine.step()
            engine.reset_prefix_cache()
        assert engine.stats.mismatched_blocks == 0
        return [(r.local_hit, r.external) for r in requests]
    finally:
        side.close()


def test_one_block_per_chunk_serves_every_state_vllm_keeps(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvoffload"):
        assert second_pass(1) == [(0, 1280)] * 4
    assert not [r for r in caplog.records if "blocks_per_chunk" in r.getMessage()]


def test_two_blocks_per_chunk_miss_a_state_inside_a_chunk_and_say_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvoffload"):
        assert second_pass(2) == [(0, 0), (1280, 0), (1280, 0), (0, 0)]
    [warning] = [r.getMessage() for r in caplog.records if "blocks_per_chunk" in r.getMessage()]
    assert warning.startswith(
        "blocks_per_chunk=2 with recurrent state groups: a hit needs a state taken on a "
        "multiple of 512 tokens"
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
