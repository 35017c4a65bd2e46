"""Prefill on one `vllm serve`, decode on another: the decode instance's time to first token.

Two servers of one model share a disk tier (``disk_path``): a producer
(``kv_role: kv_producer``) and a consumer (``kv_consumer``), each bound to a
core of its own, started side by side. Each mode sends fresh prompts of
``--prompt-tokens`` random token ids (sharing nothing), one at a time:

* ``computed``: straight to the consumer, which computes the prompt itself
  (the reference: the same engine, the same request, nothing handed off);
* ``loaded``: first the proxy's prefill stage to the producer
  (``kvoffload.cli._proxy_upstream.send_prefill``: ``max_tokens`` 1, not
  streamed), then, once the producer's chunks are on disk (the client waits
  for them, so that this TTFT is the load alone, not the hand-off's wait), the
  same request straight to the consumer, which loads the prompt from disk.
  Its TTFT is the decode instance's: what the proxy's decode stage waits;
* ``proxy``: the whole flow through the real ``kvoffload proxy`` command, no
  wait between the stages: the client's TTFT (producer's prefill, then the
  consumer's first token, after its lookup waited for the producer's stores
  still on their way), and the tokens the consumer found on disk, which show
  whether the hand-off raced those stores.

TTFT is the client's: a streaming completion, request sent to first token
received (``benchmarks/_serve.py``). Bytes moved are the servers' own
counters (``/metrics``): the producer's ``vllm:kvoffload_stored_bytes``
and the consumer's ``vllm:kvoffload_loaded_bytes`` of the disk tier, per
request. Run it in the vLLM environment::

    .venv-vllm/bin/python benchmarks/disagg_ttft.py [--json] [--help for the sizes]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests_e2e")]

from _models import MODELS, build, kv_bytes_per_token  # noqa: E402
from _serve import (  # noqa: E402
    Completion,
    Server,
    ServerError,
    ServerSpec,
    complete,
    running,
    settled_chunks,
)

from kvoffload.cli._proxy_upstream import (  # noqa: E402
    parse_upstream,
    request_headers,
    send_prefill,
)

MODES = ("computed", "loaded", "proxy")
TIMEOUT_S = 600.0
DISK = "disk"


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def specs(args: argparse.Namespace, model: Path, disk: Path) -> list[ServerSpec]:
    config = MODELS[args.model]
    bs = args.block_size
    max_model_len = math.ceil((args.prompt_tokens + args.answer_tokens) / bs) * bs
    blocks = 2 * max_model_len // bs + 8  # a request in flight, with room to spare
    kv_gib = max(1, math.ceil(blocks * bs * kv_bytes_per_token(config) / 2**30))
    connector = {"blocks_per_chunk": args.blocks_per_chunk, "cpu_bytes_to_use": "1GiB",
                 "disk_path": str(disk), "disk_bytes_to_use": "8GiB"}  # fmt: skip
    cpus = sorted(os.sched_getaffinity(0))
    return [
        ServerSpec(name=role, model=model, dtype=args.dtype, engine_blocks=blocks, block_size=bs,
                   max_model_len=max_model_len, connector=connector, reserved_cpus=1,
                   kvcache_gib=kv_gib, cores=str(cpus[i % len(cpus)]), kv_role=f"kv_{role}")
        for i, role in enumerate(("producer", "consumer"))
    ]  # fmt: skip


def nudge(server: Server) -> None:
    """A request of 8 tokens (no whole block: nothing to store or load): a server's counters
    reach ``/metrics`` with its engine's steps, and an idle engine takes none, so the last
    request's stores, which end after its answer, are counted only at a later step."""
    complete(server.port, [5] * 8, 1, TIMEOUT_S)


def disk_bytes(server: Server, name: str) -> float:
    return server.samples().get((f"vllm:kvoffload_{name}_bytes_total", DISK), 0.0)


def ask(port: int, prompt: list[int], args: argparse.Namespace) -> Completion:
    return complete(port, prompt, args.answer_tokens, TIMEOUT_S)


def hand_off(producer: Server, prompt: list[int], args: argparse.Namespace, disk: Path) -> float:
    """The proxy's prefill stage, then the wait for the producer's chunks on disk; the
    stage's seconds (the producer computing the prompt)."""
    body = {"model": "model", "prompt": prompt, "max_tokens": args.answer_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True}  # fmt: skip
    upstream = parse_upstream("prefill", f"http://127.0.0.1:{producer.port}")
    before = settled_chunks(disk, 0, timeout_s=0)
    started = time.perf_counter()
    send_prefill(upstream, "/v1/completions", body, request_headers({}), TIMEOUT_S)
    seconds = time.perf_counter() - started
    chunk_tokens = args.block_size * args.blocks_per_chunk
    settled_chunks(disk, before + (len(prompt) - 1) // chunk_tokens)
    return seconds


def row(
    done: list[Completion], loaded: float, stored: float, prefills: list[float]
) -> dict[str, Any]:
    n = len(done)
    return {
        "producer_prefill_median_ms": (
            round(statistics.median(prefills) * 1000, 1) if prefills else None
        ),
        "requests": n,
        "ttft_ms": [round(c.ttft_s * 1000, 1) for c in done],
        "ttft_median_ms": round(statistics.median(c.ttft_s for c in done) * 1000, 1),
        "cached_tokens": [c.cached_tokens for c in done],
        "disk_loaded_bytes_per_request": loaded / n,
        "disk_stored_bytes_per_request": stored / n,
    }


def timed(
    mode: str, servers: tuple[Server, Server], work: list[list[int]], args: argparse.Namespace,
    *, disk: Path, port: int,
) -> dict[str, Any]:  # fmt: skip
    producer, consumer = servers
    stored, loaded = disk_bytes(producer, "stored"), disk_bytes(consumer, "loaded")
    done, prefills = [], []
    for prompt in work:
        if mode == "loaded":
            prefills.append(hand_off(producer, prompt, args, disk))
        done.append(ask(port if mode == "proxy" else consumer.port, prompt, args))
        print(f"  {mode}: TTFT {done[-1].ttft_s * 1000:.0f} ms, "
              f"{done[-1].cached_tokens} tokens cached", file=sys.stderr)  # fmt: skip
    settled_chunks(disk, 0, timeout_s=5)
    for server in servers:  # see nudge
        nudge(server)
    return row(done, disk_bytes(consumer, "loaded") - loaded,
               disk_bytes(producer, "stored") - stored, prefills)  # fmt: skip


def proxy_command(servers: tuple[Server, Server], log: Path) -> tuple[subprocess.Popen[str], int]:
    """``kvoffload proxy`` (this checkout's) in front of the two servers; it and its port."""
    producer, consumer = servers
    argv = [sys.executable, "-m", "kvoffload", "proxy", "--port", "0",
            "--prefill", f"http://127.0.0.1:{producer.port}",
            "--decode", f"http://127.0.0.1:{consumer.port}"]  # fmt: skip
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log.open("w"), text=True,
                             env=producer.spec.env())  # fmt: skip
    assert child.stdout is not None
    line = child.stdout.readline()
    if not line.startswith("kvoffload proxy: listening on "):
        child.kill()
        raise ServerError(f"kvoffload proxy did not start: {log.read_text()[-2000:]}")
    return child, int(line.split(";")[0].rsplit(":", 1)[1])


def cpu() -> str:
    """The processor as /proc/cpuinfo names it, and the matrix flags that set prefill's cost."""
    info = Path("/proc/cpuinfo").read_text()
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines()
                 if line.startswith("model name")), "?")  # fmt: skip
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines()
                      if line.startswith("flags")), []))  # fmt: skip
    shown = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
    return f"{name}, {os.cpu_count()} cores, flags {' '.join(shown) or 'none of avx2/avx512/amx'}"


def measure(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kvoffload-disagg-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        model = build(MODELS[args.model], (args.model_dir or work) / args.model)
        disk = work / "kv"
        vocab = MODELS[args.model]["vocab_size"]
        batches = {m: prompts(args.prompts, args.prompt_tokens, vocab, seed=i + 1)
                   for i, m in enumerate(MODES)}  # fmt: skip
        print(f"model {model}; servers (logs in {work}):", file=sys.stderr)
        results: dict[str, Any] = {}
        with running(specs(args, model, disk), work, args.start_timeout) as servers:
            producer, consumer = servers
            for server in servers:  # each engine's first request pays for its warm-up
                ask(server.port, prompts(1, 64, vocab, seed=0)[0], args)
            child, port = proxy_command((producer, consumer), work / "proxy.log")
            try:
                for mode in args.modes:
                    results[mode] = timed(mode, (producer, consumer), batches[mode], args,
                                          disk=disk, port=port)  # fmt: skip
            finally:
                child.terminate()
                child.wait(timeout=30)
            records = [server.record() for server in servers]
    setup = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    return {"setup": setup, "cpu": cpu(), "servers": records, "modes": results}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add("--model", choices=["llama", "big_llama", "serve_llama"], default="big_llama",
        help="a Llama of tests_e2e/_models.py (big_llama: 8 layers, hidden 1024)")  # fmt: skip
    add("--dtype", default="bfloat16")
    add("--prompts", type=int, default=4, help="requests per mode, one at a time")
    add("--prompt-tokens", type=int, default=3072, help="tokens of each prompt")
    add("--answer-tokens", type=int, default=4, help="max_tokens of the client's requests")
    add("--block-size", type=int, default=32)
    add("--blocks-per-chunk", type=int, default=1, help="kvoffload's chunk, in blocks")
    add("--modes", default=",".join(MODES), help=f"a comma list of {', '.join(MODES)}")
    add("--start-timeout", type=float, default=900.0, help="seconds for the servers to start")
    add("--model-dir", type=Path, help="build the model here once and reuse it")
    add("--keep", type=Path, help="keep the servers' logs (and the disk tier) here")
    add("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    if not args.modes or set(args.modes) - set(MODES):
        parser.error(f"--modes: a comma list of {', '.join(MODES)}")
    for name in ("prompts", "prompt_tokens", "answer_tokens", "block_size", "blocks_per_chunk"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.prompt_tokens + args.answer_tokens > MODELS[args.model]["max_position_embeddings"]:
        parser.error("--prompt-tokens: longer than the model's positions")
    return args


LABELS = {
    "computed": "decode instance, the prompt computed there",
    "loaded": "decode instance, the prompt loaded from the producer's disk tier",
    "proxy": "client through kvoffload proxy (prefill + decode, no wait)",
}


def render(args: argparse.Namespace, result: dict[str, Any]) -> str:
    config = MODELS[args.model]
    cores = ", ".join(f"{s['name']} {s['engine_cores']}" for s in result["servers"])
    lines = [
        f"vllm serve x2 over one disk tier: {args.model} ({config['num_hidden_layers']} layers, "
        f"hidden {config['hidden_size']}), {args.dtype}, prompts of {args.prompt_tokens} tokens, "
        f"block {args.block_size}, blocks_per_chunk {args.blocks_per_chunk}; cores: {cores}",
        f"cpu: {result['cpu']}",
        f"{'mode':<68} {'TTFT ms (median)':>17} {'cached':>7} {'disk MiB in/req':>15}",
    ]
    for mode, row in result["modes"].items():
        cached = statistics.median(row["cached_tokens"])
        lines.append(
            f"{LABELS[mode]:<68} {row['ttft_median_ms']:>17.0f} {cached:>7.0f} "
            f"{row['disk_loaded_bytes_per_request'] / 2**20:>15.1f}"
        )
    modes = result["modes"]
    if "loaded" in modes:
        loaded = modes["loaded"]
        lines.append(
            f"producer: prefill stage {loaded['producer_prefill_median_ms']:.0f} ms (median), "
            f"{loaded['disk_stored_bytes_per_request'] / 2**20:.1f} MiB stored on disk a request"
        )
    if {"computed", "loaded"} <= set(modes):
        ratio = modes["computed"]["ttft_median_ms"] / modes["loaded"]["ttft_median_ms"]
        lines.append(f"computed / loaded TTFT at the decode instance: {ratio:.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers on SIGTERM too
    try:
        result = measure(args)
    except ServerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result) if args.json else render(args, result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
