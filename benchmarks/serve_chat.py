"""Multi-turn chat over `vllm serve` with a small engine KV cache: kvoffload against vLLM alone.

A real server (``vllm.entrypoints.openai.api_server``, vLLM's CPU build here)
and a real client (streaming completions over HTTP, ``_serve.py``). The
conversations share a system prompt and carry their history into every
turn; they take turns round-robin (a conversation's next turn goes to the
back of the queue), ``--concurrency`` requests in flight, so a
conversation's history waits behind the other conversations' turns: the
reuse distance that a small engine cache loses and an offload tier keeps.

Workloads (``--workloads``):

* ``chat``: the conversations, timed, on vLLM alone and on kvoffload (CPU
  tier), both with the same small engine cache (``--engine-blocks``), and
  on the limit: the same engine alone with a cache that holds every
  conversation (what kvoffload at its best could give); median and p90
  time to first token per turn, total time, tokens/s, and kvoffload's
  share of the achievable saving, ``(alone - kvoffload) / (alone - limit)``
  of the total time, and its TTFT of the last two turns against the limit's;
* ``unique``: prompts that share nothing, timed the same way: what the
  connector costs when it can never hit;
* ``check``: in float32 at concurrency 1, kvoffload with the small engine
  cache against an engine whose own cache holds every conversation (the
  same KV, reused): the answers (token ids) must be identical, or the
  script exits 1.

The lower-tier modes (``--modes lower,lower-fetch,lower-slow,lower-slow-fetch``,
``_lower.py``) serve the chat from a CPU tier that holds about a quarter of the
conversations and a disk that holds all, with requests waiting in vLLM's queue
(``--max-num-seqs`` below ``--concurrency``), without and with
``fetch_while_queued``, on this disk and on a disk slowed to what an NVMe read
is against a GPU's prefill; with ``vllm`` and ``limit`` in the same run they get
a table of their own (``make bench-serve-lower``).

Every engine gets the same ``VLLM_CPU_NUM_OF_RESERVED_CPU``: vLLM's CPU
backend reserves one core more when any KV connector is configured
(``vllm/utils/ompmultiprocessing.py``), so without it a 2-core machine
computes on two cores with the connector and on one without. The cores each
engine was bound to are read from its log and printed beside the figures.
The model is a Llama with random weights built at run time
(``tests_e2e/_models.py``); prompts are token ids. Run it in the vLLM
environment::

    .venv-vllm/bin/python benchmarks/serve_chat.py [--json] [--help for the sizes]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import tempfile
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, NoReturn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests_e2e"))  # model builders

import _lower
from _chat import (
    Ask,
    Conversation,
    conversations,
    converse,
    summary,
    threads,
    unique_prompts,
)
from _lower import LOWER_MODES, SLOW_MODES, Calibration
from _models import MODELS, build, kv_bytes_per_token
from _serve import Server, ServerError, ServerSpec, complete, running

from kvoffload.config.values import Bounds, to_size
from kvoffload.errors import ConfigError

WORKLOADS = ("chat", "unique", "check")
MODES = ("vllm", "kvoffload", "limit")
#: Timed servers run only when ``--modes`` names them.
EXTRA_MODES = ("next-step", "disk", "disk-promote", *LOWER_MODES)
REQUEST_TIMEOUT_S = 1800.0


class UsageError(ValueError):
    """Sizes or options that cannot make a run; one line, exit 2, before any server starts."""


class Parser(argparse.ArgumentParser):
    """Errors in one line: what was wrong, and where help is; exit 2."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


@dataclass(frozen=True)
class Plan:
    """What the sizes imply for the engines, checked before any server starts."""

    model: Path
    vocab: int
    max_model_len: int
    oracle_blocks: int
    #: The limit's engine cache: every timed conversation whole.
    limit_blocks: int
    kvcache_gib: int


def in_flight_blocks(args: argparse.Namespace) -> int:
    """Blocks for the requests the engine runs at once (``--concurrency``, or
    ``--max-num-seqs`` where lower) as whole conversations, and vLLM's null block.

    A smaller engine cache makes a request wait in vLLM's queue for room, with
    or without an offload tier (no load path gives that back); this one runs
    the requests in flight at once and still loses every history that waits
    behind the other conversations' turns.
    """
    running = min(args.concurrency, args.max_num_seqs or args.concurrency)
    return running * math.ceil(conversation_tokens(args) / args.block_size) + 1


def conversation_tokens(args: argparse.Namespace) -> int:
    """Tokens of a whole conversation: the system prompt and every turn."""
    return int(args.system_tokens + args.turns * (args.user_tokens + args.answer_tokens))


def plan(args: argparse.Namespace, model: Path) -> Plan:
    config = MODELS[args.model]
    chat_len = conversation_tokens(args)
    needs = [chat_len] if {"chat", "check"} & set(args.workloads) else []
    if "unique" in args.workloads:
        needs.append(args.unique_tokens + args.answer_tokens)
    bs = args.block_size
    max_model_len = math.ceil(max(needs) / bs) * bs
    if max_model_len > config["max_position_embeddings"]:
        raise UsageError(
            f"a conversation or prompt of {max(needs)} tokens is longer than the model's "
            f"{config['max_position_embeddings']} positions: lower --turns, --user-tokens, "
            "--system-tokens, --answer-tokens or --unique-tokens"
        )
    least = max_model_len // bs + 1  # vLLM keeps one block back (its null block)
    if args.engine_blocks < least:
        raise UsageError(
            f"--engine-blocks {args.engine_blocks} cannot hold one request of {max(needs)} "
            f"tokens ({bs} tokens a block, and vLLM keeps one block back): vLLM would refuse "
            f"to start; give --engine-blocks {least} or more, or lower the sizes"
        )
    oracle = max(args.engine_blocks, args.check_conversations * math.ceil(chat_len / bs) + 8)
    limit = max(args.engine_blocks, args.conversations * math.ceil(chat_len / bs) + 8)
    need = max(oracle * bs * kv_bytes_per_token(config, dtype_bytes=4),
               limit * bs * kv_bytes_per_token(config, dtype_bytes=2))  # fmt: skip
    gib = max(1, math.ceil(need / 2**30))
    return Plan(model, config["vocab_size"], max_model_len, oracle, limit, gib)


def spec(args: argparse.Namespace, p: Plan, name: str, **kw: Any) -> ServerSpec:
    base: dict[str, Any] = {
        "model": p.model,
        "dtype": args.dtype,
        "engine_blocks": args.engine_blocks,
        "block_size": args.block_size,
        "max_model_len": p.max_model_len,
        "connector": None,
        "reserved_cpus": args.reserved_cpus,
        "kvcache_gib": p.kvcache_gib,
        "max_num_seqs": args.max_num_seqs,
    }
    return ServerSpec(name=name, **{**base, **kw})


def connector(args: argparse.Namespace) -> dict[str, Any]:
    return {"blocks_per_chunk": args.blocks_per_chunk, "cpu_bytes_to_use": args.cpu_bytes}


def on_disk(args: argparse.Namespace, path: Path) -> dict[str, Any]:
    """The disk modes' connector: a CPU tier too small for the histories, a disk behind it."""
    return {**connector(args), "cpu_bytes_to_use": args.disk_cpu_bytes,
            "disk_path": str(path), "disk_bytes_to_use": "8GiB"}  # fmt: skip


def kv_per_token(args: argparse.Namespace) -> int:
    """The timed model's KV bytes a token, in the timed dtype."""
    return kv_bytes_per_token(MODELS[args.model], _lower.dtype_bytes(args.dtype))


def lower_cpu_bytes(args: argparse.Namespace) -> int:
    """The lower modes' CPU tier: the system prompt and ``--lower-cpu-share`` of the rest."""
    chunk = args.block_size * args.blocks_per_chunk
    return _lower.cpu_tier_bytes(
        args.conversations, args.lower_cpu_share, conversation_tokens(args), args.system_tokens,
        chunk_bytes=chunk * kv_per_token(args), chunk_tokens=chunk,
    )  # fmt: skip


def lower_spec(
    args: argparse.Namespace, p: Plan, work: Path, name: str, cal: Calibration
) -> ServerSpec:
    extra = _lower.connector(connector(args), lower_cpu_bytes(args), work / f"kv-{name}",
                             name, args.lower_queued_share)  # fmt: skip
    return spec(args, p, name, connector=extra, extra_env=_lower.environment(name, cal.rate))


def chat(args: argparse.Namespace, p: Plan, n: int) -> tuple[list[int], list[Conversation]]:
    return conversations(n, args.turns, args.system_tokens, args.user_tokens, p.vocab)


def asker(server: Server, answer_tokens: int) -> Ask:
    return lambda prompt: complete(server.port, prompt, answer_tokens, REQUEST_TIMEOUT_S)


def timed_mode(
    args: argparse.Namespace,
    p: Plan,
    s: ServerSpec,
    work: Path,
    workloads: tuple[str, ...],
    *,
    cal: Calibration | None = None,
) -> dict[str, Any]:
    """One server, alone on the machine: a warm-up request, then each timed workload.

    ``cal`` not yet measured: this machine's prefill is measured first (for the slow disk).
    """
    out: dict[str, Any] = {}
    with running([s], work, args.start_timeout) as [server]:
        out["server"] = server.record()
        ask = asker(server, args.answer_tokens)
        ask(unique_prompts(1, 64, p.vocab, seed=2)[0].questions[0])
        if cal is not None and cal.rate is None:
            calibrate(args, p, cal, server)
        lower = s.name in LOWER_MODES
        for workload in workloads:
            if workload not in args.workloads:
                continue
            system, convs = (
                chat(args, p, args.conversations)
                if workload == "chat"
                else ([], unique_prompts(args.unique_prompts, args.unique_tokens, p.vocab))
            )
            before, samples = server.metrics(), server.samples() if lower else {}
            seconds = converse(ask, system, convs, args.concurrency)
            out[workload] = summary(convs, seconds, before, server.metrics())
            if lower:
                kv = _lower.counters(samples, server.samples())
                if s.name in SLOW_MODES:
                    kv["slowed_chunks"] = _lower.fired(server)
                out[workload]["kvoffload"] = kv
            print(f"  {s.name} {workload}: {seconds:.1f} s", file=sys.stderr)
    return out


def calibrate(args: argparse.Namespace, p: Plan, cal: Calibration, server: Server) -> None:
    """This machine's prefill of a token on ``server``, and the slow disk's rate from it."""
    tokens = min(args.system_tokens + args.user_tokens, p.max_model_len - 1)
    _lower.calibrate(
        cal, server, tokens, p.vocab, ratio=args.slow_read_ratio, kv_per_token=kv_per_token(args)
    )
    print(
        f"  prefill {1000 * cal.seconds_per_token:.3f} ms a token ({tokens} tokens on "
        f"{server.spec.name}): slow disk at {(cal.rate or 0) / 1e6:.2f} MB/s",
        file=sys.stderr,
    )


def check(args: argparse.Namespace, p: Plan, work: Path) -> dict[str, Any]:
    """kvoffload with the small engine cache against a cache that holds everything, float32.

    The two servers run side by side (nothing is timed here), each at
    concurrency 1, on the same conversations.
    """
    # Each on a core of its own where there are two (vLLM would bind both to the first).
    cpus = [str(cpu) for cpu in sorted(os.sched_getaffinity(0))]
    specs = [
        spec(args, p, "oracle-f32", dtype="float32", engine_blocks=p.oracle_blocks,
             cores=cpus[0]),
        spec(args, p, "kvoffload-f32", dtype="float32", connector=connector(args),
             cores=cpus[1 % len(cpus)]),
    ]  # fmt: skip
    runs = [chat(args, p, args.check_conversations) for _ in specs]
    with running(specs, work, args.start_timeout) as servers, threads(2) as pool:
        before = servers[1].metrics()
        futures = [
            pool.submit(converse, asker(server, args.answer_tokens), system, convs, 1)
            for server, (system, convs) in zip(servers, runs, strict=True)
        ]
        for future in futures:
            future.result()
        after = servers[1].metrics()
        records = [server.record() for server in servers]
    oracle, kv = ([t for c in convs for t in c.turns] for _, convs in runs)
    bs = args.block_size
    # The oracle reused every full block of the history (all of it was computed but the
    # last answer token), or it is no oracle.
    oracle_full = all(
        t.answer.cached_tokens == (t.history_tokens - 1) // bs * bs
        for t in oracle if t.history_tokens > args.system_tokens
    )  # fmt: skip
    pairs = list(zip(oracle, kv, strict=True))
    hits = "vllm:external_prefix_cache_hits_total", "vllm:prefix_cache_hits_total"
    return {
        "answers": len(pairs),
        "identical": sum(a.answer.tokens == b.answer.tokens for a, b in pairs),
        "same_cached_tokens": sum(
            a.answer.cached_tokens == b.answer.cached_tokens for a, b in pairs
        ),
        "oracle_reused_all_history": oracle_full,
        "oracle_cached_tokens": [t.answer.cached_tokens for t in oracle],
        "kvoffload_cached_tokens": [t.answer.cached_tokens for t in kv],
        "connector_hit_tokens": int(after[hits[0]] - before[hits[0]]),
        "engine_hit_tokens": int(after[hits[1]] - before[hits[1]]),
        "servers": records,
        "oracle_engine_blocks": p.oracle_blocks,
    }


def ttft_cells(row: dict[str, Any]) -> str:
    return "".join(f"{t['ttft_median_s']:>6.2f} /{t['ttft_p90_s']:>6.2f}" for t in row["per_turn"])


def print_timed(args: argparse.Namespace, modes: dict[str, dict[str, Any]], workload: str) -> None:
    if workload == "chat":
        print(
            f"\nchat: {args.conversations} conversations x {args.turns} turns "
            f"({args.system_tokens}-token shared system prompt, {args.user_tokens} user + "
            f"{args.answer_tokens} answer tokens a turn), concurrency {args.concurrency}"
        )
        turns = "".join(f"{f'turn {i + 1}':>14}" for i in range(args.turns))
    else:
        print(
            f"\nunique: {args.unique_prompts} prompts x {args.unique_tokens} tokens sharing "
            f"nothing, {args.answer_tokens} answer tokens, concurrency {args.concurrency}"
        )
        turns = f"{'all':>14}"
    w = max(10, *(len(name) for name in modes))  # the lower modes' names are longer
    print(
        f"{'mode':<{w}} {'total s':>8} {'tokens/s':>9}  TTFT median / p90 s:{turns} "
        f"{'engine hits':>12} {'kvoffload hits':>15} {'preempted':>10}"
    )
    for name, figures in modes.items():
        if workload not in figures:
            continue
        row = figures[workload]
        print(
            f"{name:<{w}} {row['seconds']:>8.1f} {row['tokens_per_s']:>9.1f}  {'':>20}"
            f"{ttft_cells(row)} {row['engine_hit_tokens']:>12} "
            f"{row['connector_hit_tokens']:>15} {row['preemptions']:>10}"
        )
    if {"vllm", "kvoffload"} <= set(modes):
        plain, kv = modes["vllm"][workload], modes["kvoffload"][workload]
        print(
            f"vllm / kvoffload total time: {plain['seconds'] / kv['seconds']:.2f}x; "
            f"median TTFT of the last turn {kv['per_turn'][-1]['ttft_median_s']:.2f} s "
            f"with kvoffload, {plain['per_turn'][-1]['ttft_median_s']:.2f} s without"
        )
    if workload == "chat" and {"vllm", "kvoffload", "limit"} <= set(modes):
        f = against_limit(modes)
        print(
            f"the limit finishes {f['limit_speedup']:.2f}x sooner than vLLM alone; kvoffload "
            f"realizes {f['share_of_saving']:.0%} of that saving; median TTFT of the last two "
            f"turns {f['ttft_vs_limit']:.2f}x the limit's"
        )


def against_limit(modes: dict[str, dict[str, Any]]) -> dict[str, float]:
    """kvoffload between vLLM alone and the limit (the chat workload, the same run)."""
    alone, kv, limit = (modes[m]["chat"] for m in ("vllm", "kvoffload", "limit"))

    def last_two(row: dict[str, Any]) -> float:
        return sum(t["ttft_median_s"] for t in row["per_turn"][-2:])

    saving = alone["seconds"] - limit["seconds"]
    return {
        "limit_speedup": alone["seconds"] / limit["seconds"],
        "share_of_saving": (alone["seconds"] - kv["seconds"]) / saving if saving else 0.0,
        "ttft_vs_limit": last_two(kv) / last_two(limit),
    }


def print_check(args: argparse.Namespace, c: dict[str, Any]) -> None:
    print(
        f"\ncheck (float32, concurrency 1, {args.check_conversations} conversations x "
        f"{args.turns} turns): {c['identical']} of {c['answers']} answers of kvoffload with "
        f"{args.engine_blocks} engine blocks identical to those of an engine with "
        f"{c['oracle_engine_blocks']} (its own cache holds everything"
        f"{'' if c['oracle_reused_all_history'] else ': NOT TRUE, it lost some history'}); "
        f"cached tokens equal on {c['same_cached_tokens']}; kvoffload loaded "
        f"{c['connector_hit_tokens']} tokens, vLLM's own cache served "
        f"{c['engine_hit_tokens']}; engine cores "
        + ", ".join(f"{s['name']} {s['engine_cores']}" for s in c["servers"])
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = Parser(
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add(
        "--model",
        choices=["llama", "big_llama", "serve_llama"],
        default="big_llama",
        help="a Llama of tests_e2e/_models.py (big_llama: 8 layers, hidden 1024)",
    )
    add("--dtype", default="bfloat16", help="of the timed workloads; the check is float32")
    add("--conversations", type=int, default=8)
    add("--turns", type=int, default=5)
    add("--system-tokens", type=int, default=1024, help="the shared system prompt")
    add("--user-tokens", type=int, default=512, help="new tokens of each turn")
    add("--answer-tokens", type=int, default=16, help="max_tokens of every request")
    add("--concurrency", type=int, default=2, help="requests in flight (timed workloads)")
    add("--unique-prompts", type=int, default=8)
    add("--unique-tokens", type=int, default=1500)
    add("--check-conversations", type=int, default=6, help="of the float32 check")
    add("--engine-blocks", type=int, default=None,
        help="the engine's own KV cache, in blocks; by default room for --concurrency whole "
             "conversations in flight (the requests a server runs at once), not for the "
             "other conversations' histories")  # fmt: skip
    add("--block-size", type=int, default=32)
    add(
        "--blocks-per-chunk",
        type=int,
        default=1,
        help="kvoffload's chunk; 1 hits at vLLM's own block boundaries, as the check needs",
    )
    add("--cpu-bytes", default="2GiB", help="kvoffload's CPU tier (cpu_bytes_to_use)")
    add(
        "--reserved-cpus",
        type=int,
        default=1,
        help="VLLM_CPU_NUM_OF_RESERVED_CPU of every engine: cores kept from its OpenMP threads",
    )
    add("--workloads", default=",".join(WORKLOADS), help="a comma list of chat, unique, check")
    add("--modes", default=",".join(MODES),
        help="the timed servers, a comma list of vllm, kvoffload, limit, next-step "
             "(kvoffload with load_in_step: never, every hit loaded a step later), disk "
             "(kvoffload with a disk tier behind a CPU tier of --disk-cpu-bytes), "
             "disk-promote (the same with KVOFFLOAD_LOWER_TIER_HITS=promote), and the "
             "lower-tier modes lower, lower-fetch (fetch_while_queued), lower-slow and "
             "lower-slow-fetch (the same two on a slow disk), which need --max-num-seqs "
             "below --concurrency")  # fmt: skip
    add("--disk-cpu-bytes", default="256MiB",
        help="the CPU tier of the disk modes: too small for the histories, so hits come "
             "from disk")  # fmt: skip
    add("--max-num-seqs", type=int, default=None,
        help="vLLM's --max-num-seqs in every server: requests it runs at once; below "
             "--concurrency the others wait in its queue (default: vLLM's)")  # fmt: skip
    add("--lower-cpu-share", type=float, default=0.25,
        help="the lower modes' CPU tier holds the system prompt and this share of the "
             "conversations' own tokens")  # fmt: skip
    add("--lower-queued-share", type=float, default=0.6,
        help="the lower modes' queued_cpu_share: a waiting request's whole history must fit "
             "for it to be fetched, and this small a tier holds about two")  # fmt: skip
    add("--slow-read-ratio", type=float, default=round(_lower.GPU_RATIO, 3),
        help="the slow disk reads a token's KV in this many times this machine's prefill of "
             "a token: an NVMe read of Llama-3.1-8B's KV against an H100's prefill "
             "(benchmarks/_lower.py)")  # fmt: skip
    add("--slow-read-rate", default=None,
        help="the slow disk's rate as given (e.g. 20MB/s), instead of one measured from "
             "this machine's prefill")  # fmt: skip
    add("--start-timeout", type=float, default=900.0, help="seconds for a server to start")
    add("--model-dir", type=Path, help="build the model here once and reuse it")
    add("--keep", type=Path, help="keep the servers' logs here")
    add("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    args.workloads = [w for w in args.workloads.split(",") if w]
    if not args.workloads or set(args.workloads) - set(WORKLOADS):
        parser.error(f"--workloads: a comma list of {', '.join(WORKLOADS)}")
    args.modes = [m for m in args.modes.split(",") if m]
    if set(args.modes) - {*MODES, *EXTRA_MODES}:
        parser.error(f"--modes: a comma list of {', '.join((*MODES, *EXTRA_MODES))}")
    if args.engine_blocks is None:
        args.engine_blocks = in_flight_blocks(args)
    sizes = ("conversations", "turns", "system_tokens", "user_tokens", "answer_tokens",
             "concurrency", "unique_prompts", "unique_tokens", "check_conversations",
             "engine_blocks", "block_size", "blocks_per_chunk")  # fmt: skip
    for name in sizes:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.reserved_cpus < 0:
        parser.error("--reserved-cpus must be 0 or more")
    check_lower(parser, args)
    return args


def check_lower(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The options of the lower-tier modes, and the queue they need."""
    if args.max_num_seqs is not None and args.max_num_seqs < 1:
        parser.error("--max-num-seqs must be at least 1")
    for name in ("lower_cpu_share", "lower_queued_share"):
        if not 0 < getattr(args, name) <= 1:
            parser.error(f"--{name.replace('_', '-')} must be a fraction in (0, 1]")
    if not (args.slow_read_ratio > 0 and math.isfinite(args.slow_read_ratio)):
        parser.error("--slow-read-ratio must be a number above 0")
    if args.slow_read_rate is not None:
        text = args.slow_read_rate
        try:
            if not text.endswith("/s"):
                raise ConfigError(text)
            args.slow_read_rate = float(to_size("--slow-read-rate", text[:-2], Bounds(1, 2**60)))
        except ConfigError:
            parser.error(f"--slow-read-rate {text!r}: give a size a second, e.g. 20MB/s or 1GiB/s")
    lower = [m for m in args.modes if m in LOWER_MODES]
    if lower and not (args.max_num_seqs and args.max_num_seqs < args.concurrency):
        parser.error(
            f"--modes {','.join(lower)}: requests wait in vLLM's queue only with --max-num-seqs "
            f"below --concurrency (e.g. --concurrency 3 --max-num-seqs 2)"
        )
    if lower and "chat" not in args.workloads:
        parser.error(f"--modes {','.join(lower)} serve the chat workload: add chat to --workloads")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every mode the workloads need, one server after the other (the check's two at once)."""
    with tempfile.TemporaryDirectory(prefix="kvoffload-serve-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        model = (args.model_dir or work) / args.model
        p = plan(args, model)  # the sizes are checked before the model is built
        build(MODELS[args.model], model)
        print(f"model {model}; servers (logs in {work}):", file=sys.stderr)
        modes: dict[str, dict[str, Any]] = {}
        both, chat_only = ("chat", "unique"), ("chat",)
        servers = {
            "vllm": (lambda: spec(args, p, "vllm"), both),
            "kvoffload": (lambda: spec(args, p, "kvoffload", connector=connector(args)), both),
            "next-step": (lambda: spec(args, p, "next-step",
                          connector={**connector(args), "load_in_step": "never"}), both),
            "limit": (lambda: spec(args, p, "limit", engine_blocks=p.limit_blocks), chat_only),
            "disk": (lambda: spec(args, p, "disk", connector=on_disk(args, work / "kv-disk")),
                     chat_only),
            "disk-promote": (lambda: spec(args, p, "disk-promote",
                                          connector=on_disk(args, work / "kv-disk-promote"),
                                          extra_env=(("KVOFFLOAD_LOWER_TIER_HITS", "promote"),)),
                             chat_only),
        }  # fmt: skip
        cal = Calibration(rate=args.slow_read_rate, given=args.slow_read_rate is not None)
        for name in LOWER_MODES:
            servers[name] = (partial(lower_spec, args, p, work, name, cal), chat_only)
        order = run_order(args.modes, cal)
        if cal.rate is None and order and order[0] in SLOW_MODES:  # nothing runs before them
            with running([spec(args, p, "prefill-probe")], work, args.start_timeout) as [probe]:
                calibrate(args, p, cal, probe)
        for name in order:
            make, workloads = servers[name]
            if set(workloads) & set(args.workloads):
                first = cal.rate is None and any(m in SLOW_MODES for m in order)
                modes[name] = timed_mode(
                    args, p, make(), work, workloads, cal=cal if first else None
                )
        checked = check(args, p, work) if "check" in args.workloads else None
    ok = checked is None or (
        checked["identical"] == checked["answers"] and checked["oracle_reused_all_history"]
    )
    setup = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    setup["max_model_len"] = p.max_model_len
    if set(args.modes) & set(LOWER_MODES):
        setup["lower_cpu_bytes"] = lower_cpu_bytes(args)
        setup["lower_chunk_bytes"] = args.block_size * args.blocks_per_chunk * kv_per_token(args)
        setup["calibration"] = cal.record() if cal.rate is not None else None
    return {"setup": setup, "modes": modes, "check": checked, "ok": ok}


def run_order(modes: list[str], cal: Calibration) -> list[str]:
    """``modes`` in their order, the slow-disk ones last where their rate is to be measured
    (on the first server), announced when that moves them."""
    if cal.rate is not None:
        return list(modes)
    order = [m for m in modes if m not in SLOW_MODES] + [m for m in modes if m in SLOW_MODES]
    if order != modes:
        print(f"the slow-disk modes run last: {', '.join(order)}", file=sys.stderr)
    return order


def print_setup(args: argparse.Namespace, modes: dict[str, dict[str, Any]]) -> None:
    cfg = MODELS[args.model]
    cores = ", ".join(f"{name} {m['server']['engine_cores']}" for name, m in modes.items())
    print(
        f"vllm serve (vLLM CPU backend), {args.model} ({cfg['num_hidden_layers']} layers, "
        f"hidden {cfg['hidden_size']}), timed in {args.dtype}; engine KV cache "
        f"{args.engine_blocks} blocks x {args.block_size} tokens; kvoffload CPU tier "
        f"{args.cpu_bytes}, blocks_per_chunk {args.blocks_per_chunk}\n"
        f"cores: VLLM_CPU_NUM_OF_RESERVED_CPU={args.reserved_cpus} in every engine"
        + (f"; engine bound to cores: {cores}" if cores else "")
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers on SIGTERM too
    try:
        result = measure(args)
    except UsageError as exc:
        print(f"serve_chat.py: error: {exc}", file=sys.stderr)
        return 2
    except ServerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if {"vllm", "kvoffload", "limit"} <= set(result["modes"]):
        result["against_limit"] = against_limit(result["modes"])
    if args.json:
        print(json.dumps(result))
    else:
        print_setup(args, result["modes"])
        for workload in ("chat", "unique"):
            if workload in args.workloads:
                print_timed(args, result["modes"], workload)
        if set(args.modes) & set(LOWER_MODES):
            print("\n".join(_lower.table(result["modes"], result["setup"])))
        if result["check"] is not None:
            print_check(args, result["check"])
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
