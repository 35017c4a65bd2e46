"""Retention against storing every chunk, on a Gemma-style layout and a multi-turn trace.

What it measures, per ``retention_interval`` (``1`` stores every chunk, the
reference): the bytes each request stores in the CPU tier, the history a
fixed CPU budget can still serve at the end of the trace (the hit each
conversation's next turn would get), and the multi-turn hit ratio (tokens
served by kvoffload over prompt tokens).

The layout is Gemma-3-27B's shape on a GPU: per group ten layers, 16-token
blocks, 8 KiB of KV per token and layer (16 KV heads of 128, bf16); five
sliding-window groups (window 1024) and one full-attention group;
``blocks_per_chunk`` 16, so 256-token chunks of 20 MiB each. The run moves
real bytes through kvoffload's own scheduler and worker (``OffloadScheduler``,
``OffloadWorker``, ``OffloadEngine``, the CPU tier), with pages of a few
bytes so it fits any machine; byte figures are the chunks stored times the
real chunk size.

vLLM's part is played by the package's stand-in (``kvoffload.standin``,
the one the demo, ``kvoffload replay`` and the tests use) driving the
connector's two sides (``KVOffloadSide``: ``get_num_new_matched_tokens``,
``update_state_after_alloc``, ``build_connector_meta``, the worker around the
forward pass): one request at a time, its prompt in chunked-prefill steps of
8,192 tokens, then its output decoded; sliding-window blocks freed once they
leave the window; vLLM's own prefix cache off (``enable_prefix_caching``
false), so every hit comes from the CPU tier. Decode steps end on chunk
boundaries rather than every token (``decode_tokens`` 256, every group's
chunk span): the stores planned are those of one-token steps, since a chunk
ends only where a step ends and every hit point is a chunk boundary.

The trace: ``--conversations`` conversations share a 2,048-token system
prompt, each then reads its own document (16K tokens of context in all), and
takes turns (a user message of 1,000-3,000 tokens, an answer of 300-1,200)
until its context passes 32K tokens; turns of different conversations
interleave at random (seeded). Run it in the core environment::

    .venv/bin/python benchmarks/retention.py [--conversations 48] [--cpu-gib 512] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass
from typing import Any

from kvoffload import build_offloading_config
from kvoffload.config.layout import CacheGroup, KVLayout
from kvoffload.keys import namespace_of
from kvoffload.standin import KVOffloadSide, StandIn
from kvoffload.transfer import allocate_kv_caches

TOKENS_PER_BLOCK = 16
BLOCKS_PER_CHUNK = 16
WINDOW = 1024
LAYERS_PER_GROUP = 10
SLIDING_GROUPS = 5
#: vLLM's default ``max_num_batched_tokens`` for ``vllm serve`` (chunked prefill).
STEP_TOKENS = 8192
SPAN = TOKENS_PER_BLOCK * BLOCKS_PER_CHUNK
#: Real KV bytes of one 16-token block of one layer: 16 tokens x 16 KV heads x 128 x 2 x bf16.
REAL_PAGE = TOKENS_PER_BLOCK * 16 * 128 * 2 * 2
#: What the run moves per page instead (any size works; the chunk count is what matters).
PAGE = 64
GIB = 1 << 30
MOONCAKE = "/work/shared/traces/mooncake_conversation_trace.jsonl"


def layout(page: int) -> KVLayout:
    def names(g: int) -> tuple[str, ...]:
        return tuple(f"g{g}.l{i}" for i in range(LAYERS_PER_GROUP))

    sliding = [
        CacheGroup("sliding", TOKENS_PER_BLOCK, names(g), page, sliding_window=WINDOW)
        for g in range(SLIDING_GROUPS)
    ]
    return KVLayout((*sliding, CacheGroup("full", TOKENS_PER_BLOCK, names(SLIDING_GROUPS), page)))


REAL_CHUNK = layout(REAL_PAGE).groups[0].chunk_bytes(BLOCKS_PER_CHUNK)


@dataclass
class Turn:
    conversation: int
    prompt: list[int]
    output: list[int]


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 150_000) for _ in range(n)]


def synthetic_trace(conversations: int, seed: int) -> list[Turn]:
    """Conversations of long turns (see ``--synthetic``), interleaved at random (seeded)."""
    rng = random.Random(seed)
    system = _tokens(rng, 2048)
    pending: list[list[Turn]] = []
    for c in range(conversations):
        context = system + _tokens(rng, 16_384 - len(system))
        turns = []
        while len(context) < 32_768:
            output = _tokens(rng, rng.randint(300, 1200))
            turns.append(Turn(c, list(context), output))
            context = context + output + _tokens(rng, rng.randint(1000, 3000))
        pending.append(turns)
    order = []
    while any(pending):
        live = [turns for turns in pending if turns]
        order.append(rng.choice(live).pop(0))
    return order


def _sessions(rows: list[dict[str, Any]]) -> list[list[int]]:
    """Requests (indices) per session: a request joins the session of the longest earlier
    request it shares two or more 512-token blocks with."""
    sessions: list[list[int]] = []
    owner: dict[tuple[int, ...], int] = {}
    for i, row in enumerate(rows):
        ids = tuple(row["hash_ids"])
        found = next((owner[ids[:k]] for k in range(len(ids) - 1, 1, -1) if ids[:k] in owner),
                     None)  # fmt: skip
        if found is None:
            found = len(sessions)
            sessions.append([])
        sessions[found].append(i)
        for k in range(2, len(ids) + 1):
            owner.setdefault(ids[:k], found)
    return sessions


def mooncake_trace(path: str, sessions: int, seed: int) -> list[Turn]:
    """The first ``sessions`` multi-turn sessions of a Mooncake trace whose contexts stay
    within 16K-32K tokens, in trace order, as token ids.

    A session's first prompt expands each 512-token block id into its own
    tokens (so prompts of different sessions share what the trace says they
    share); each later prompt is the previous prompt, its output and new
    tokens, cut to the trace's input length (a prompt shorter than the last
    one plus its output is a retry or a cut context).
    """
    with open(path, encoding="utf-8") as lines:
        rows = [json.loads(line) for line in lines if line.strip()]
    chosen = [
        s for s in _sessions(rows)
        if len(s) > 1 and all(16_384 <= rows[i]["input_length"] <= 32_768 for i in s)
    ][:sessions]  # fmt: skip
    rng = random.Random(seed)
    blocks: dict[int, list[int]] = {}
    turns: list[tuple[int, Turn]] = []
    for c, session in enumerate(chosen):
        stream: list[int] = []
        for i in session:
            row = rows[i]
            length, output = row["input_length"], _tokens(rng, max(1, row["output_length"]))
            if not stream:
                for block in row["hash_ids"]:
                    stream += blocks.setdefault(block, _tokens(rng, 512))
            stream = stream[:length] + _tokens(rng, max(0, length - len(stream)))
            turns.append((i, Turn(c, stream[:length], output)))
            stream = stream[:length] + output
    return [turn for _, turn in sorted(turns, key=lambda t: t[0])]


def serve(
    turns: list[Turn], interval: int, cpu_chunks: int, step_tokens: int = STEP_TOKENS
) -> tuple[StandIn, KVOffloadSide]:
    """``turns`` through the stand-in and kvoffload's connector sides, one request at a time."""
    real = layout(PAGE)
    config = build_offloading_config(
        {
            "cpu_bytes_to_use": cpu_chunks * real.groups[0].chunk_bytes(BLOCKS_PER_CHUNK),
            "blocks_per_chunk": BLOCKS_PER_CHUNK,
            "retention_interval": interval,
            "eviction_policy": "lru",
        },
        real,
    )
    # Room for the longest request in every group; vLLM's own cache keeps nothing between them.
    longest = max(len(t.prompt) + len(t.output) for t in turns)
    gpu_blocks = len(real.groups) * (longest // TOKENS_PER_BLOCK + 2) + 1  # 0: the null block
    kv = allocate_kv_caches(real, gpu_blocks)
    namespace = namespace_of("gemma-style", "bfloat16", real)
    side = KVOffloadSide(config, namespace, kv, record_events=False)  # nobody reads them
    # Decode steps end on chunk boundaries (see the module docstring): the same stores.
    engine = StandIn(real, side, gpu_blocks=gpu_blocks, step_tokens=step_tokens,
                     decode_tokens=SPAN, prefix_caching=False)  # fmt: skip
    engine.run(((f"r{i}", t.prompt, t.output) for i, t in enumerate(turns)), in_flight=1)
    return engine, side


def servable(side: KVOffloadSide, context: list[int]) -> int:
    """The hit the next turn on ``context`` would get now (a side-effect-free lookup)."""
    hit = side.scheduler.lookup("probe", [*context, 1], 0) or 0
    side.scheduler.request_finished("probe")
    return hit


def run(turns: list[Turn], interval: int, cpu_chunks: int, step_tokens: int) -> dict[str, Any]:
    started = time.perf_counter()
    engine, side = serve(turns, interval, cpu_chunks, step_tokens)
    last = {turn.conversation: turn for turn in turns}
    history = sum(servable(side, t.prompt + t.output) for t in last.values())
    figures, stats = side.scheduler.stats(), engine.stats
    side.close()
    assert stats.requests == len(turns) and stats.failed_load_tokens == 0, stats
    stored, dropped = figures["stored_chunks"], figures["dropped_chunks"]
    return {
        "retention_interval": interval,
        "requests": len(turns),
        "stored_mib_per_request": stored * REAL_CHUNK / len(turns) / (1 << 20),
        "kept_mib_per_request": (stored - dropped) * REAL_CHUNK / len(turns) / (1 << 20),
        "resident_gib": figures["index_ready"] * REAL_CHUNK / GIB,
        "history_tokens_per_gib": history / (cpu_chunks * REAL_CHUNK / GIB),
        "hit_ratio": stats.external_tokens / stats.prompt_tokens,
        "dropped_chunks": dropped,
        "evictions": figures["index_evictions"],
        "steps": stats.steps,
        "seconds": time.perf_counter() - started,
    }


def table(rows: list[dict[str, Any]], reference: dict[str, Any]) -> str:
    lines = [
        "| retention_interval | written per request | kept per request | history tokens per GiB "
        "| vs every chunk | multi-turn hit ratio |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        name = "1 (every chunk)" if row["retention_interval"] == 1 else row["retention_interval"]
        ratio = row["history_tokens_per_gib"] / reference["history_tokens_per_gib"]
        lines.append(
            f"| {name} | {row['stored_mib_per_request']:,.0f} MiB | "
            f"{row['kept_mib_per_request']:,.0f} MiB | "
            f"{row['history_tokens_per_gib']:,.0f} | {ratio:.2f}x | {row['hit_ratio']:.1%} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", default=MOONCAKE, help="Mooncake-format trace (JSON lines)")
    parser.add_argument("--conversations", type=int, default=120, help="sessions replayed")
    parser.add_argument(
        "--synthetic",
        action="store_true",
        help="a synthetic trace of long turns instead (see synthetic_trace)",
    )
    parser.add_argument("--cpu-gib", type=float, default=512.0, help="CPU tier, real bytes")
    parser.add_argument("--intervals", default="1,0,16384", help="retention_interval values")
    parser.add_argument(
        "--step-tokens", type=int, default=STEP_TOKENS, help="tokens a step computes at most"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.synthetic:
        turns = synthetic_trace(args.conversations, args.seed)
    else:
        turns = mooncake_trace(args.trace, args.conversations, args.seed)
    cpu_chunks = int(args.cpu_gib * GIB // REAL_CHUNK)
    rows = [run(turns, int(i), cpu_chunks, args.step_tokens) for i in args.intervals.split(",")]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{args.conversations} conversations, {len(turns)} requests, CPU tier "
          f"{args.cpu_gib:g} GiB ({cpu_chunks} chunks of {REAL_CHUNK >> 20} MiB)")  # fmt: skip
    reference = next((r for r in rows if r["retention_interval"] == 1), rows[0])
    print(table(rows, reference))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
