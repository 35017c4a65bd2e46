"""The generator of ``kvoffload/examples/demo_trace.jsonl``, the demo's bundled trace.

A Mooncake-format trace (``hash_ids`` of 512-token blocks, prefix-chained) of
multi-turn conversations that open with one of a few shared system prompts,
interleaved in time, so a replay sees three kinds of reuse: the shared
prompts, each conversation's earlier turns, and nothing at all (first turns
after an eviction). Regenerate with::

    python -m kvoffload.cli._demo_trace > kvoffload/examples/demo_trace.jsonl

``tests/test_demo.py`` checks that the bundled file is exactly this output.
"""

from __future__ import annotations

import json
import random
import sys
from typing import Any

from kvoffload.replay.trace import TRACE_BLOCK_TOKENS

__all__ = ["generate_demo_trace"]


def generate_demo_trace(
    conversations: int = 48, system_prompts: int = 4, seed: int = 2026
) -> list[dict[str, Any]]:
    """Requests in arrival order: ``timestamp`` (ms), ``input_length``, ``output_length``, ids."""
    rng = random.Random(seed)
    next_id = iter(range(1, 1 << 62))
    prompts = [[next(next_id) for _ in range(rng.randint(1, 2))] for _ in range(system_prompts)]
    pending: list[list[list[int]]] = []
    for _ in range(conversations):
        ids = list(rng.choice(prompts))
        turns = []
        for _ in range(rng.randint(1, 4)):
            ids = ids + [next(next_id) for _ in range(rng.randint(1, 2))]
            if len(ids) > 6:
                break
            turns.append(ids)
        pending.append(turns)
    requests: list[dict[str, Any]] = []
    clock = 0
    while any(pending):
        turns = rng.choice([t for t in pending if t])
        ids = turns.pop(0)
        clock += rng.randint(50, 400)
        tail = rng.randint(1, TRACE_BLOCK_TOKENS)  # the last block is partly filled
        requests.append(
            {
                "timestamp": clock,
                "input_length": (len(ids) - 1) * TRACE_BLOCK_TOKENS + tail,
                "output_length": rng.randint(16, 256),
                "hash_ids": ids,
            }
        )
    return requests


def main() -> None:  # pragma: no cover - a maintenance script
    for record in generate_demo_trace():
        sys.stdout.write(json.dumps(record) + "\n")


if __name__ == "__main__":  # pragma: no cover
    main()
