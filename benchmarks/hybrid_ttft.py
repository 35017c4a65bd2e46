"""Time to first token on hybrid models: a CPU-tier hit loaded one step later or in its step.

``vllm_ttft.py``'s load (conversations sharing a system prompt, the last turn
of each timed one request at a time, ``max_tokens=1``, vLLM's prefix cache
reset before each) on a model of several KV cache groups:

* ``gemma4``: Gemma-4's sliding-window and full-attention layers (four KV
  cache groups: three of 512 tokens per block, one of 32);
* ``qwen3_next``: Qwen3-Next's gated-DeltaNet layers (recurrent states, in
  vLLM's ``mamba_cache_mode="align"``) beside full attention.

Modes, each in its own engine process: ``recompute`` (no connector),
``kvoffload cpu, next step`` (``load_in_step: auto``, which on these layouts
loads one step later: vLLM could not take a failed load in the step back),
``kvoffload cpu, in the step`` (``load_in_step: always``: every group kind,
a state into the block vLLM runs it in), and ``vllm prefix cache`` (not
reset: the ideal, where it hits as much; its hybrid cache may hit less). "same
tokens" compares each row with the next-step row: the two connector modes load
the same KV, so they must agree. Run it in the vLLM environment::

    .venv-vllm/bin/python benchmarks/hybrid_ttft.py [--family gemma4] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from vllm_ttft import ROOT, add_ratios, passes_of, row, run_engine

sys.path.insert(0, str(ROOT / "tests_e2e"))
from _models import GEMMA4, QWEN3_NEXT, build


def gemma4(layers: int, hidden: int) -> dict[str, Any]:
    """Gemma-4 with three sliding-window layers to one full-attention layer."""
    kinds = ["sliding_attention"] * 3 + ["full_attention"]
    return {**GEMMA4, "num_hidden_layers": layers, "hidden_size": hidden,
            "intermediate_size": hidden * 11 // 4,
            "layer_types": [kinds[i % 4] for i in range(layers)]}  # fmt: skip


def qwen3_next(layers: int, hidden: int) -> dict[str, Any]:
    """Qwen3-Next with three gated-DeltaNet layers to one full-attention layer."""
    return {**QWEN3_NEXT, "num_hidden_layers": layers, "hidden_size": hidden,
            "moe_intermediate_size": hidden * 11 // 16,
            "shared_expert_intermediate_size": hidden * 11 // 16}  # fmt: skip


FAMILIES = {
    "gemma4": (gemma4, {"block_size": 32}),
    "qwen3_next": (qwen3_next, {"enable_prefix_caching": True, "mamba_cache_mode": "align"}),
}


def arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--family", choices=sorted(FAMILIES), default="gemma4")
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--turn-tokens", type=int, default=256)
    parser.add_argument("--turns", type=int, default=3, help="the last one is timed")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--model-dir", type=Path, help="build the model here once and reuse it")
    parser.add_argument(
        "--reserved-cpus",
        type=int,
        default=1,
        help="VLLM_CPU_NUM_OF_RESERVED_CPU of every engine process (the same in every mode)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.turns < 2:
        parser.error("--turns must be at least 2 (earlier turns are stored, the last is timed)")
    if args.layers < 4 or args.layers % 4:
        parser.error("--layers must be a multiple of 4 (three of each four are hybrid layers)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    make, engine_args = FAMILIES[args.family]
    config = make(args.layers, args.hidden)
    with tempfile.TemporaryDirectory(prefix="kvoffload-hybrid-ttft-") as tmp:
        work = Path(tmp)
        name = f"{args.family}-l{args.layers}-h{args.hidden}"
        model = str(build(config, (args.model_dir or work) / name))
        vocab = config["vocab_size"]
        last, warmup, fill, timed = passes_of(args, vocab)
        base = {
            "model": model,
            "engine": {**engine_args, "max_model_len": max(4096, len(last[0]) + 16),
                       "disable_log_stats": False},
            "prompts": last,
            "max_tokens": 1,
        }  # fmt: skip
        passes = [warmup, fill, timed]
        plain = run_engine(
            {**base, "passes": [warmup, fill, {"prompts": last, "one_by_one": True}, timed]},
            work, "recompute", args.reserved_cpus,
        )  # fmt: skip
        results = {}
        for setting in ("auto", "always"):
            connector = {"cpu_bytes_to_use": "2GiB", "load_in_step": setting}
            spec = {**base, "passes": passes, "connector": connector}
            results[setting] = run_engine(
                spec, work, f"kvoffload-cpu-{setting}", args.reserved_cpus
            )
    rows = [
        row("recompute", plain, 3),
        row("kvoffload cpu, next step (auto)", results["auto"], 2),
        row("kvoffload cpu, in the step (always)", results["always"], 2),
        row("vllm prefix cache", plain, 2),
    ]
    # Both connector modes load the same KV, so their tokens must agree; recompute and vLLM's
    # cache compute other prefixes, which in bfloat16 may flip near-tied tokens.
    add_ratios(rows, same_as=1)
    setup = {"family": args.family, "layers": args.layers, "hidden": args.hidden,
             "kv_cache_groups": plain["kv_cache_groups"], "prompt_tokens": len(last[0]),
             "conversations": args.conversations, "reserved_cpus": args.reserved_cpus}  # fmt: skip
    if args.json:
        print(json.dumps({"setup": setup, "rows": rows}))
    else:
        print(f"{args.family}: {setup}")
        print(f"{'mode':<37} {'TTFT ms':>8} {'cached':>7} {'in step':>8} "
              f"{'recompute/mode':>15} {'mode/own cache':>15}  same tokens")  # fmt: skip
        for r in rows:
            print(f"{r['mode']:<37} {r['ttft_ms']:>8.0f} {r['cached_tokens']:>7.0f} "
                  f"{r.get('in_step_hit_tokens', '-')!s:>8} {r['ratio_vs_recompute']:>14.2f}x "
                  f"{r['ratio_vs_own_cache']:>14.2f}x  {r['same_tokens']}")  # fmt: skip
    return 0 if rows[2]["same_tokens"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
