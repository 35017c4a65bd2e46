"""Does anything a cache sees tell which turns of a conversation trace are continued?

For each request, its *new part* is the blocks no earlier request had; it is *continued*
if a later request reads one of them (the knowledge Belady and a client's hints have).
Printed: the share of requests continued, by what an online policy could see of them at
their arrival: the conversation's depth (1 for a first turn, which reads only shared
blocks), the gap since the previous turn of the conversation, and the new part's size;
and the median gap until the continuing request. The figures back docs/benchmarks.md
("Replay with arrivals", why the targets without hints are out of reach)::

    .venv/bin/python benchmarks/continuation_stats.py \\
        ../shared/traces/mooncake_conversation_trace.jsonl
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from collections.abc import Callable

from kvoffload.replay import load_trace

SHARED_BLOCKS = 1  # the trace's common system prompt: every request reads block 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", help="a Mooncake-format trace with timestamps")
    trace = load_trace(parser.parse_args().trace)
    requests, arrivals = trace.requests, trace.arrivals
    first_owner: dict[bytes, int] = {}  # block -> the request whose new part it is
    depth = [0] * len(requests)
    since_previous: list[float | None] = [None] * len(requests)
    new_size = [0] * len(requests)
    continued_after: list[float | None] = [None] * len(requests)
    for i, blocks in enumerate(requests):
        owners = {first_owner[b] for b in blocks[SHARED_BLOCKS:] if b in first_owner}
        for j in owners:
            if continued_after[j] is None:
                continued_after[j] = arrivals[i] - arrivals[j]
        if owners:
            previous = max(owners)
            depth[i] = depth[previous] + 1
            since_previous[i] = arrivals[i] - arrivals[previous]
        for block in blocks:
            if block not in first_owner:
                first_owner[block] = i
                new_size[i] += 1
    print(f"{trace.name}: {len(requests)} requests, {sum(c is not None for c in continued_after)}"
          " continued")  # fmt: skip

    def minutes(i: int) -> int | None:
        gap = since_previous[i]
        return None if gap is None else min(int(gap // 60), 10)

    by: dict[str, Callable[[int], int | None]] = {
        "depth": lambda i: min(depth[i] + 1, 6),
        "minutes since the previous turn": minutes,
        "new blocks (groups of 4)": lambda i: min(new_size[i] // 4, 8),
    }
    for name, key in by.items():
        groups: dict[int, list[int]] = defaultdict(list)
        for i in range(len(requests)):
            if (k := key(i)) is not None:
                groups[k].append(i)
        print(f"by {name}: share continued (requests), median seconds until continued")
        for k in sorted(groups):
            members = groups[k]
            gaps = [g for i in members if (g := continued_after[i]) is not None]
            median = f"{statistics.median(gaps):.0f}" if gaps else "-"
            print(f"  {k:>3}: {len(gaps) / len(members):.2f} ({len(members)}), {median}")


if __name__ == "__main__":
    main()
