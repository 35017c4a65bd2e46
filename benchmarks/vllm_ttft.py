"""Time to first token with kvoffload against recomputation, on a real vLLM engine (CPU build).

Multi-turn conversations share a long system prompt and carry their history
into the next turn. A first pass runs every conversation's earlier turns
(with the connector, their KV is stored); then the last turn of each
conversation is timed one request at a time with ``max_tokens=1``, vLLM's
prefix cache reset before each, so the only thing that can skip the prefill
of the history is the connector:

* ``recompute``: no connector; every last turn is prefilled whole (the
  reference of the ratios);
* ``kvoffload cpu``: the connector (CPU tier only) loads the history from
  its CPU tier, in the step that asks for it (``load_in_step``'s default on
  this one-group model);
* ``kvoffload cpu, <mode> copies``: the same with each way a load in the step
  may copy (``KVOFFLOAD_IN_STEP_COPIES``, ``kvoffload/engine/_layered.py``): a
  copy thread layer after layer, each layer in its ``wait_for_layer_load``, or
  all before the forward pass; the plain row is the device's default;
* ``kvoffload cpu, next step``: the same with ``load_in_step: never``, the
  way every hit loaded before: vLLM schedules the request one step later;
* ``kvoffload disk``: one process stores the earlier turns (CPU tier and
  disk tier behind it) and exits; a fresh engine process (empty CPU tier,
  empty vLLM cache) on the same disk directory loads the history from the
  disk tier (the page cache of the OS may hold the files);
* ``kvoffload disk, promoted first``: the same with
  ``KVOFFLOAD_LOWER_TIER_HITS=promote`` (``kvoffload/connector/promotions.py``):
  the lookup has the history read into the CPU tier and answers "ask again",
  then the hit loads in the step that finds it there;
* ``vllm prefix cache``: vLLM's own cache, not reset (the ideal, for scale).

Every mode runs in its own engine process (``tests_e2e/_runner.py``) and
first warms up on an unrelated prompt. Every engine process gets the same
``VLLM_CPU_NUM_OF_RESERVED_CPU`` (``--reserved-cpus``): where vLLM binds the
engine's threads (its multiprocessing executor) it reserves one core more when
a KV connector is configured. The runner's engine is in-process (uniprocess
executor, no binding), so each mode computes with torch's threads, which the
table shows per mode. The model has random weights (Llama,
8 layers, hidden size 1024 by default), big enough that prefill costs real
time on a CPU. Run it in the vLLM environment::

    .venv-vllm/bin/python benchmarks/vllm_ttft.py [--conversations 4] [--json]

TTFT is the wall time of one ``generate()`` of ``max_tokens=1`` (vLLM's own
``first_token_latency`` from ``RequestOutput.metrics`` is shown beside it);
each figure is a median over the conversations. The ratios are recompute's
TTFT over the mode's, and the mode's over vLLM's own cache's, from the same
run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests_e2e"))  # the random-weight model builders live there

from _launch import EngineFailed, run_spec  # noqa: E402
from _models import BIG_LLAMA, build  # noqa: E402
from _runner import stat_delta  # noqa: E402

#: KVOFFLOAD_IN_STEP_COPIES's values (kvoffload.engine._layered.CopyMode; not imported:
#: this script runs in the vLLM environment, where kvoffload may be another checkout's).
COPY_MODES = ("thread", "layer", "before")


def conversations(
    n: int, system: int, turn: int, turns: int, vocab: int, *, seed: int = 0
) -> tuple[list[list[int]], list[list[int]]]:
    """(earlier turns, last turns): ``n`` conversations of ``turns`` turns after ``system``.

    Turn ``t`` of a conversation is the shared system prompt, then ``t`` blocks
    of ``turn`` tokens of its own (the history and the new question).
    """
    rng = random.Random(seed)
    shared = [rng.randrange(1, vocab) for _ in range(system)]
    earlier, last = [], []
    for _ in range(n):
        own = [rng.randrange(1, vocab) for _ in range(turn * turns)]
        earlier += [shared + own[: turn * t] for t in range(1, turns)]
        last.append(shared + own)
    return earlier, last


def passes_of(
    args: argparse.Namespace, vocab: int
) -> tuple[list[list[int]], dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The last turns, and the passes over them: a warm-up on an unrelated prompt, the
    earlier turns (``fill``), and the last turns one by one, vLLM's cache reset before each."""
    earlier, last = conversations(
        args.conversations, args.system_tokens, args.turn_tokens, args.turns, vocab
    )
    warmup = {"prompts": [[random.Random(1).randrange(1, vocab) for _ in range(256)]]}
    fill = {"prompts": earlier}
    timed = {"prompts": last, "one_by_one": True, "reset_each": True}
    return last, warmup, fill, timed


def add_ratios(rows: list[dict[str, Any]], same_as: int = 0) -> None:
    """Each row's ratios to the first row (recompute) and the last (vLLM's own cache), and
    whether its tokens are row ``same_as`` 's (its ``tokens`` are dropped)."""
    reference_ms, own_ms = rows[0]["ttft_ms"], rows[-1]["ttft_ms"]
    tokens = rows[same_as]["tokens"]
    for r in rows:
        r["ratio_vs_recompute"] = reference_ms / r["ttft_ms"]
        r["ratio_vs_own_cache"] = r["ttft_ms"] / own_ms
        r["same_tokens"] = r.pop("tokens") == tokens


def run_engine(
    spec: dict[str, Any], work: Path, name: str, reserved_cpus: int, **extra: str
) -> dict[str, Any]:
    """One engine process on ``spec`` (``extra``: more environment); its result."""
    # The same in every mode: vLLM's CPU backend reserves one core more when a KV
    # connector is configured (vllm/utils/ompmultiprocessing.py), where it binds threads.
    env = {**os.environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": str(reserved_cpus), **extra}
    started = time.perf_counter()
    try:
        result = run_spec(spec, work, name, env=env)
    except EngineFailed as exc:
        raise SystemExit(f"{name}: {exc}") from None
    if result["error"]:
        raise SystemExit(f"{name}: engine did not start:\n{result['error']}")
    print(f"  {name}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return result


def row(name: str, result: dict[str, Any], n: int) -> dict[str, Any]:
    """The figures of timed pass ``n`` of one mode."""
    passes = result["passes"]
    p = passes[n]
    ttft = statistics.median(p["prompt_seconds"])
    out: dict[str, Any] = {
        "mode": name,
        "ttft_ms": 1000 * ttft,
        "vllm_ttft_ms": 1000 * statistics.median(p["ttft"]) if p.get("ttft") else None,
        "cached_tokens": statistics.median(p["cached"]),
        "tokens": p["tokens"],
        "torch_threads": result["torch_threads"],
    }
    if p.get("stats"):
        out["loaded_tokens"] = stat_delta(passes, n, "scheduler", "loaded_tokens")
        out["cpu_hit_chunks"] = stat_delta(passes, n, "scheduler", "cpu_hit_chunks")
        out["lower_hit_chunks"] = stat_delta(passes, n, "scheduler", "lower_hit_chunks")
        out["failed_loads"] = stat_delta(passes, n, "scheduler", "failed_loads")
        out["promotions"] = stat_delta(passes, n, "scheduler", "promotions")
        out["in_step_hit_tokens"] = stat_delta(passes, n, "scheduler", "in_step_hit_tokens")
    return out


def arguments(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """The command line, checked; and the copy modes it asks rows for."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--turn-tokens", type=int, default=256)
    parser.add_argument("--turns", type=int, default=3, help="the last one is timed")
    parser.add_argument("--layers", type=int, default=BIG_LLAMA["num_hidden_layers"])
    parser.add_argument("--hidden", type=int, default=BIG_LLAMA["hidden_size"])
    parser.add_argument("--block-size", type=int, default=32, help="vLLM's block_size")
    parser.add_argument("--blocks-per-chunk", type=int, default=4)
    parser.add_argument("--model-dir", type=Path, help="build the model here once and reuse it")
    parser.add_argument(
        "--reserved-cpus",
        type=int,
        default=1,
        help="VLLM_CPU_NUM_OF_RESERVED_CPU of every engine process (the same in every mode)",
    )
    parser.add_argument(
        "--copy-modes",
        default="thread,layer",
        help="more cpu rows, one per way a load in the step copies (KVOFFLOAD_IN_STEP_COPIES: "
        "thread, layer, before; the default row is the device's default); '' for none",
    )
    parser.add_argument("--keep", type=Path, help="keep specs, results and logs here")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.turns < 2:
        parser.error("--turns must be at least 2 (earlier turns are stored, the last is timed)")
    copy_modes = [m.strip() for m in args.copy_modes.split(",") if m.strip()]
    if bad := [m for m in copy_modes if m not in COPY_MODES]:
        parser.error(f"--copy-modes: {', '.join(bad)} is not one of {', '.join(COPY_MODES)}")
    return args, copy_modes


def main(argv: list[str] | None = None) -> int:
    args, copy_modes = arguments(argv)

    config = {
        **BIG_LLAMA,
        "num_hidden_layers": args.layers,
        "hidden_size": args.hidden,
        "intermediate_size": args.hidden * 11 // 4,
    }
    with tempfile.TemporaryDirectory(prefix="kvoffload-ttft-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        model_dir = (args.model_dir or work) / f"llama-l{args.layers}-h{args.hidden}"
        model = str(build(config, model_dir))
        vocab = config["vocab_size"]
        last, warmup, fill, timed = passes_of(args, vocab)
        base = {
            "model": model,
            "engine": {
                "block_size": args.block_size,
                "max_model_len": max(4096, len(last[0]) + 16),
                "disable_log_stats": False,  # RequestOutput.metrics
            },
            "prompts": last,
            "max_tokens": 1,
        }
        connector = {"blocks_per_chunk": args.blocks_per_chunk, "cpu_bytes_to_use": "2GiB"}
        # A process of its own stores the earlier turns on disk, so the disk-mode process
        # finds exactly the history the cpu mode loads (not the cpu mode's timed turns too).
        on_disk = {**connector, "disk_path": str(work / "kv"), "disk_bytes_to_use": "4GiB"}
        print(f"model {model}; engine processes:", file=sys.stderr)
        plain = run_engine(
            {
                **base,
                "passes": [warmup, fill, {"prompts": last, "one_by_one": True}, timed],
            },
            work,
            "recompute",
            args.reserved_cpus,
        )
        with_cpu = run_engine(
            {**base, "connector": connector, "passes": [warmup, fill, timed]},
            work,
            "kvoffload-cpu",
            args.reserved_cpus,
        )
        by_mode = {
            mode: run_engine(
                {**base, "connector": connector, "passes": [warmup, fill, timed]},
                work,
                f"kvoffload-cpu-{mode}",
                args.reserved_cpus,
                KVOFFLOAD_IN_STEP_COPIES=mode,
            )
            for mode in copy_modes
        }
        next_step = run_engine(
            {**base, "connector": {**connector, "load_in_step": "never"},
             "passes": [warmup, fill, timed]},
            work,
            "kvoffload-cpu-next-step",
            args.reserved_cpus,
        )  # fmt: skip
        run_engine(
            {**base, "connector": on_disk, "passes": [fill]},
            work,
            "kvoffload-disk-store",
            args.reserved_cpus,
        )
        # Each disk mode reads the same files: the first one's own stores must not serve the next.
        shutil.copytree(work / "kv", work / "kv-promoted")
        with_disk = run_engine(
            {**base, "connector": on_disk, "passes": [warmup, timed]},
            work,
            "kvoffload-disk",
            args.reserved_cpus,
        )
        promoted = run_engine(
            {
                **base,
                "connector": {**on_disk, "disk_path": str(work / "kv-promoted")},
                "passes": [warmup, timed],
            },
            work,
            "kvoffload-disk-promoted",
            args.reserved_cpus,
            KVOFFLOAD_LOWER_TIER_HITS="promote",
        )

    rows = [
        row("recompute", plain, 3),
        row("kvoffload cpu", with_cpu, 2),
        *(row(f"kvoffload cpu, {mode} copies", by_mode[mode], 2) for mode in copy_modes),
        row("kvoffload cpu, next step", next_step, 2),
        row("kvoffload disk", with_disk, 1),
        row("kvoffload disk, promoted first", promoted, 1),
        row("vllm prefix cache", plain, 2),
    ]
    add_ratios(rows)
    setup = {
        "model": {"layers": args.layers, "hidden": args.hidden, "vocab": vocab},
        "conversations": args.conversations,
        "prompt_tokens": len(last[0]),
        "stored_history_tokens": len(last[0]) - args.turn_tokens,
        "block_size": args.block_size,
        "blocks_per_chunk": args.blocks_per_chunk,
        "reserved_cpus": args.reserved_cpus,
    }
    if args.json:
        print(json.dumps({"setup": setup, "rows": rows}))
        return 0
    print(
        f"{args.conversations} conversations; timed turn: {len(last[0])} tokens, "
        f"{setup['stored_history_tokens']} of them from earlier turns "
        f"({args.system_tokens} shared system prompt); Llama {args.layers} layers, "
        f"hidden {args.hidden}; chunks of {args.blocks_per_chunk} x {args.block_size} tokens; "
        f"VLLM_CPU_NUM_OF_RESERVED_CPU={args.reserved_cpus} in every engine process"
    )
    print(
        f"{'mode':<31} {'TTFT ms':>9} {'vLLM TTFT':>10} {'cached':>7} {'from disk':>10} "
        f"{'recompute/mode':>15} {'mode/own cache':>15}  same tokens  torch threads"
    )
    for r in rows:
        vllm_ttft = f"{r['vllm_ttft_ms']:.0f}" if r["vllm_ttft_ms"] is not None else "-"
        disk_chunks = r.get("lower_hit_chunks", "-")
        print(
            f"{r['mode']:<31} {r['ttft_ms']:>9.0f} {vllm_ttft:>10} {r['cached_tokens']:>7.0f} "
            f"{disk_chunks!s:>10} {r['ratio_vs_recompute']:>14.2f}x "
            f"{r['ratio_vs_own_cache']:>14.2f}x  {r['same_tokens']!s:<11}  {r['torch_threads']}"
        )
    return 0 if all(r["same_tokens"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
