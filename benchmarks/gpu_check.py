"""GPU check: device<->host GB/s of kvoffload's transfer path against a plain pinned ``copy_``.

For each chunk size it builds a synthetic model (``--layers`` layers, 4
blocks per chunk, FlashAttention's ``[2, num_blocks, ...]`` CUDA tensors),
a pinned :class:`~kvoffload.tiers.cpu.CPUSlab` slab, and moves ``--total-mib``
of KV with :class:`~kvoffload.transfer.KVTransfer`:

* **store (D2H)**: ``gather`` engine blocks into slab slots, 8 chunks a call,
  as the engine's store jobs do;
* **load (H2D)**: ``scatter`` them back.

The reference is one ``copy_`` of a contiguous CUDA buffer of the same size
to and from a pinned host buffer. Rows come for consecutive block ids (one
copy per layer per chunk) and shuffled ones (an ``index_select`` per layer
per chunk). A round trip of the first job is checked bit-exact.

Run: ``python benchmarks/gpu_check.py [--chunk-mib 1,4,16] [--total-mib 1024]
[--json-out FILE]``. Prints a table, then one JSON list. Without CUDA it
prints why and exits 0, so it is safe anywhere.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import torch

from kvoffload.config.layout import CacheGroup, KVLayout
from kvoffload.messages import BlockSpan
from kvoffload.tiers.cpu import CPUSlab
from kvoffload.transfer import KVTransfer, allocate_kv_caches, fill_blocks
from kvoffload.transfer.synthetic import EngineLayout

BLOCKS_PER_CHUNK, TOKENS_PER_BLOCK, CHUNKS_PER_JOB = 4, 16, 8


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(nbytes: int, fn: Callable[[], None], repeat: int) -> float:
    """Best GB/s of ``repeat`` runs after one warm-up, each ended by a device synchronise."""
    fn()
    best = 0.0
    for _ in range(repeat):
        synchronize()
        start = time.perf_counter()
        fn()
        synchronize()
        best = max(best, nbytes / (time.perf_counter() - start) / 1e9)
    return best


def reference(nbytes: int, repeat: int, device_name: str) -> tuple[float, float]:
    """D2H and H2D GB/s of one contiguous ``copy_`` between CUDA and pinned memory."""
    device = torch.empty(nbytes, dtype=torch.uint8, device=device_name)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device_name == "cuda")

    def d2h() -> None:
        host.copy_(device, non_blocking=True)

    def h2d() -> None:
        device.copy_(host, non_blocking=True)

    return timed(nbytes, d2h, repeat), timed(nbytes, h2d, repeat)


def model(chunk_bytes: int, layers: int) -> KVLayout:
    page = chunk_bytes // (layers * BLOCKS_PER_CHUNK)
    names = tuple(f"layer{i}" for i in range(layers))
    return KVLayout(groups=(CacheGroup("full", TOKENS_PER_BLOCK, names, page),))


def make_jobs(chunks: int, shuffled: bool) -> list[tuple[range, BlockSpan]]:
    """Store/load jobs of ``CHUNKS_PER_JOB`` slots each, with their engine block ids."""
    blocks = chunks * BLOCKS_PER_CHUNK
    ids = torch.randperm(blocks).tolist() if shuffled else list(range(blocks))
    jobs = []
    for first in range(0, chunks, CHUNKS_PER_JOB):
        slots = range(first, min(first + CHUNKS_PER_JOB, chunks))
        span = ids[slots.start * BLOCKS_PER_CHUNK : slots.stop * BLOCKS_PER_CHUNK]
        jobs.append((slots, BlockSpan(tuple(span))))
    return jobs


def measure(chunk_bytes: int, args: argparse.Namespace, shuffled: bool) -> dict[str, Any]:
    """One row: the transfer path's D2H/H2D rates for ``chunk_bytes`` chunks."""
    chunks = max(CHUNKS_PER_JOB, int(args.total_mib * 2**20) // chunk_bytes)
    nbytes = chunks * chunk_bytes
    layout = model(chunk_bytes, args.layers)
    caches = allocate_kv_caches(layout, chunks * BLOCKS_PER_CHUNK, torch.bfloat16,
                                EngineLayout.KV_FIRST, device=args.device)  # fmt: skip
    fill_blocks(caches)
    transfer = KVTransfer(layout, caches, BLOCKS_PER_CHUNK)
    tier = CPUSlab(chunks, chunk_bytes, pin_memory=args.device == "cuda")
    jobs = make_jobs(chunks, shuffled)

    def store() -> None:
        for slots, span in jobs:
            transfer.gather(0, span, [tier.slot(s, chunk_bytes) for s in slots])

    def load() -> None:
        for slots, span in jobs:
            transfer.scatter(0, span, [tier.slot(s, chunk_bytes) for s in slots])

    d2h, h2d = timed(nbytes, store, args.repeat), timed(nbytes, load, args.repeat)
    exact = check_round_trip(transfer, tier, caches, jobs[0], chunk_bytes)
    ref_d2h, ref_h2d = reference(nbytes, args.repeat, args.device)
    return {
        "chunk_bytes": chunk_bytes,
        "block_ids": "shuffled" if shuffled else "consecutive",
        "d2h_gbps": d2h,
        "h2d_gbps": h2d,
        "ref_d2h_gbps": ref_d2h,
        "ref_h2d_gbps": ref_h2d,
        "bit_exact": exact,
    }


def check_round_trip(
    transfer: KVTransfer,
    tier: CPUSlab,
    caches: dict[str, torch.Tensor],
    job: tuple[range, BlockSpan],
    chunk_bytes: int,
) -> bool:
    """Gather one job, zero its blocks on the device, scatter back: equal to the original?"""
    slots, span = job
    index = torch.tensor(span.block_ids, device=transfer.device)
    before = {name: t.index_select(1, index).clone() for name, t in caches.items()}
    buffers = [tier.slot(s, chunk_bytes) for s in slots]
    transfer.gather(0, span, buffers)
    for t in caches.values():
        t.index_fill_(1, index, 0)
    transfer.scatter(0, span, buffers)
    synchronize()
    return all(  # compare bits: the random bf16 patterns include NaNs, which never equal
        torch.equal(caches[n].index_select(1, index).view(torch.uint8), b.view(torch.uint8))
        for n, b in before.items()
    )


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'chunk':>9} {'blocks':>11} | {'D2H':>6} {'ref':>6} {'ratio':>6} | "
        f"{'H2D':>6} {'ref':>6} {'ratio':>6} | exact"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['chunk_bytes'] / 2**20:>5.2f} MiB {r['block_ids']:>11} | {r['d2h_gbps']:>6.2f} "
            f"{r['ref_d2h_gbps']:>6.2f} {r['d2h_gbps'] / r['ref_d2h_gbps']:>6.0%} | "
            f"{r['h2d_gbps']:>6.2f} {r['ref_h2d_gbps']:>6.2f} "
            f"{r['h2d_gbps'] / r['ref_h2d_gbps']:>6.0%} | {r['bit_exact']}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunk-mib", default="1,4,16")
    parser.add_argument("--total-mib", type=float, default=1024.0)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json-out", type=Path, default=None)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: dry-run the path on host tensors")  # fmt: skip
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible to torch; nothing to measure (skipped).")
        return 0
    where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (dry run)"
    print(f"gpu_check on {where}, torch {torch.__version__}", flush=True)
    rows = []
    for mib in args.chunk_mib.split(","):
        for shuffled in (False, True):
            rows.append(measure(int(float(mib) * 2**20), args, shuffled))
            if args.device == "cuda":
                torch.cuda.empty_cache()  # the row's tensors are gone; give their memory back
    print(table(rows))
    print(json.dumps(rows))
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    return 0 if all(r["bit_exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
