"""GPU check: device<->host GB/s of kvoffload's transfer path against a plain pinned ``copy_``.

For each chunk size and engine tensor layout it builds a synthetic model
(``--layers`` layers, 4 blocks per chunk, 16 tokens per block), a pinned
:class:`~kvoffload.tiers.cpu.CPUSlab`, and moves ``--total-mib`` of KV:

* **staged** (what the connector runs): :class:`~kvoffload.transfer.KVTransfer`
  on CUDA, through device staging (one kernel per layer, one DMA per chunk);
* **direct**: the same calls with ``staged=False``, straight strided copies
  between the engine tensors and host memory, the first CUDA path;
* **engine**: the worker's :class:`~kvoffload.engine.OffloadEngine` (two job
  threads, a stream each, slab bookkeeping), store jobs then load jobs.

Store (D2H) ``gather``\\s engine blocks into slab slots, ``--chunks-per-job``
chunks a call, as the engine's store jobs do; load (H2D) ``scatter``\\s them
back. Layouts: FlashAttention's ``[2, num_blocks, ...]`` (``kv_first``) and
FlashInfer's / the CPU backend's ``[num_blocks, 2, ...]`` (``block_first``).
Rows come for consecutive block ids and shuffled ones. The reference is one
``copy_`` of a contiguous CUDA buffer of the same size to and from a pinned
host buffer, measured in the same run. Every path's round trip of one job is
checked bit-exact, the engine's of every job.

Run: ``python benchmarks/gpu_check.py [--chunk-mib 1,4,16] [--total-mib 1024]
[--json-out FILE]``. Prints a table, then one JSON object. Without CUDA it
prints why and exits 0, so it is safe anywhere; ``--device cpu`` dry-runs
every path on host tensors. Exit 1 if a round trip was not bit-exact.
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
from kvoffload.engine import ChunkSpan, JobStatus, OffloadEngine
from kvoffload.messages import BlockSpan
from kvoffload.tiers.cpu import CPUSlab
from kvoffload.transfer import KVTransfer, allocate_kv_caches, fill_blocks
from kvoffload.transfer.synthetic import EngineLayout

BLOCKS_PER_CHUNK, TOKENS_PER_BLOCK = 4, 16
LAYOUTS = {"kv_first": EngineLayout.KV_FIRST, "block_first": EngineLayout.BLOCK_FIRST}


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
    """D2H and H2D GB/s of one contiguous ``copy_`` between the device and pinned memory."""
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


def make_jobs(chunks: int, per_job: int, shuffled: bool) -> list[tuple[range, BlockSpan]]:
    """Store/load jobs of ``per_job`` slots each, with their engine block ids."""
    blocks = chunks * BLOCKS_PER_CHUNK
    ids = torch.randperm(blocks).tolist() if shuffled else list(range(blocks))
    jobs = []
    for first in range(0, chunks, per_job):
        slots = range(first, min(first + per_job, chunks))
        span = ids[slots.start * BLOCKS_PER_CHUNK : slots.stop * BLOCKS_PER_CHUNK]
        jobs.append((slots, BlockSpan(tuple(span))))
    return jobs


class Setup:
    """One chunk size and tensor layout: engine tensors, a pinned slab, the reference rates."""

    def __init__(self, chunk_bytes: int, layout_name: str, args: argparse.Namespace) -> None:
        self.chunk_bytes = chunk_bytes
        self.layout_name = layout_name
        self.chunks = max(args.chunks_per_job, int(args.total_mib * 2**20) // chunk_bytes)
        self.nbytes = self.chunks * chunk_bytes
        self.layout = model(chunk_bytes, args.layers)
        self.caches = allocate_kv_caches(
            self.layout, self.chunks * BLOCKS_PER_CHUNK, torch.bfloat16,
            LAYOUTS[layout_name], device=args.device,
        )  # fmt: skip
        fill_blocks(self.caches)
        self.pinned = args.device == "cuda"
        self.tier = CPUSlab(self.chunks, chunk_bytes, pin_memory=self.pinned)
        self.args = args

    def row(self, ids: str, path: str, d2h: float, h2d: float, exact: bool) -> dict[str, Any]:
        return {
            "chunk_bytes": self.chunk_bytes, "layout": self.layout_name, "block_ids": ids,
            "path": path, "d2h_gbps": d2h, "h2d_gbps": h2d, "bit_exact": exact,
        }  # fmt: skip

    def transfer_row(self, shuffled: bool, staged: bool) -> dict[str, Any]:
        """``gather`` / ``scatter`` calls on the calling thread, one job's chunks a call."""
        transfer = KVTransfer(self.layout, self.caches, BLOCKS_PER_CHUNK, staged=staged)
        jobs = make_jobs(self.chunks, self.args.chunks_per_job, shuffled)
        size, tier = self.chunk_bytes, self.tier

        def store() -> None:
            for slots, span in jobs:
                transfer.gather(0, span, [tier.slot(s, size) for s in slots])

        def load() -> None:
            for slots, span in jobs:
                transfer.scatter(0, span, [tier.slot(s, size) for s in slots])

        d2h = timed(self.nbytes, store, self.args.repeat)
        h2d = timed(self.nbytes, load, self.args.repeat)
        exact = self.round_trip(transfer, jobs[0])
        ids = "shuffled" if shuffled else "consecutive"
        return self.row(ids, "staged" if staged else "direct", d2h, h2d, exact)

    def round_trip(self, transfer: KVTransfer, job: tuple[range, BlockSpan]) -> bool:
        """Gather one job, zero its blocks on the device, scatter back: equal to the original?"""
        slots, span = job
        index = torch.tensor(span.block_ids, device=transfer.device)
        dim = 1 if self.layout_name == "kv_first" else 0
        before = {n: t.index_select(dim, index).clone() for n, t in self.caches.items()}
        buffers = [self.tier.slot(s, self.chunk_bytes) for s in slots]
        transfer.gather(0, span, buffers)
        for t in self.caches.values():
            t.index_fill_(dim, index, 0)
        transfer.scatter(0, span, buffers)
        synchronize()
        after = {n: t.index_select(dim, index) for n, t in self.caches.items()}
        # Compare bits: the random bf16 patterns include NaNs, which never equal.
        return all(torch.equal(after[n].view(torch.uint8), b.view(torch.uint8))
                   for n, b in before.items())  # fmt: skip

    def engine_row(self, shuffled: bool) -> dict[str, Any]:
        """Store jobs, then load jobs, through the worker's engine (the connector's path)."""
        transfer = KVTransfer(self.layout, self.caches, BLOCKS_PER_CHUNK)
        engine = OffloadEngine.create(transfer, self.tier, max_workers=2)
        jobs = make_jobs(self.chunks, self.args.chunks_per_job, shuffled)
        spans = [
            [ChunkSpan(0, tuple(b"k%d" % s for s in slots), tuple(slots), span)]
            for slots, span in jobs
        ]
        ok = True

        def run(submit: Callable[[list[ChunkSpan]], int]) -> None:
            nonlocal ok
            for job in spans:
                submit(job)
            engine.wait()
            ok &= all(r.status is JobStatus.SUCCESS for r in engine.get_finished())

        try:
            d2h = timed(self.nbytes, lambda: run(engine.submit_store), self.args.repeat)
            want = {n: t.clone() for n, t in self.caches.items()}
            for t in self.caches.values():
                t.zero_()
            h2d = timed(self.nbytes, lambda: run(engine.submit_load), self.args.repeat)
            synchronize()
            ok &= all(
                torch.equal(t.view(torch.uint8), want[n].view(torch.uint8))
                for n, t in self.caches.items()
            )
        finally:
            engine.close()
        return self.row("shuffled" if shuffled else "consecutive", "engine", d2h, h2d, ok)


def measure(chunk_bytes: int, layout_name: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    setup = Setup(chunk_bytes, layout_name, args)
    ref_d2h, ref_h2d = reference(setup.nbytes, args.repeat, args.device)
    rows = []
    for shuffled in (False, True):
        for path in args.paths.split(","):
            if path == "engine":
                rows.append(setup.engine_row(shuffled))
            else:
                rows.append(setup.transfer_row(shuffled, staged=path == "staged"))
            print(table(rows[-1:], header=False, ref=(ref_d2h, ref_h2d)), flush=True)
    for row in rows:
        row.update(ref_d2h_gbps=ref_d2h, ref_h2d_gbps=ref_h2d)
    return rows


HEAD = (
    f"{'chunk':>9} {'layout':>11} {'blocks':>11} {'path':>6} | {'D2H':>6} {'ref':>6} "
    f"{'ratio':>6} | {'H2D':>6} {'ref':>6} {'ratio':>6} | exact"
)


def table(
    rows: list[dict[str, Any]], header: bool = True, ref: tuple[float, float] | None = None
) -> str:
    lines = [HEAD, "-" * len(HEAD)] if header else []
    for r in rows:
        rd, rh = ref or (r["ref_d2h_gbps"], r["ref_h2d_gbps"])
        lines.append(
            f"{r['chunk_bytes'] / 2**20:>5.2f} MiB {r['layout']:>11} {r['block_ids']:>11} "
            f"{r['path']:>6} | {r['d2h_gbps']:>6.2f} {rd:>6.2f} {r['d2h_gbps'] / rd:>6.0%} | "
            f"{r['h2d_gbps']:>6.2f} {rh:>6.2f} {r['h2d_gbps'] / rh:>6.0%} | {r['bit_exact']}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunk-mib", default="1,4,16")
    parser.add_argument("--layouts", default="kv_first,block_first")
    parser.add_argument("--paths", default="staged,direct,engine")
    parser.add_argument("--total-mib", type=float, default=1024.0)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--chunks-per-job", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json-out", type=Path, default=None)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: dry-run the paths on host tensors")  # fmt: skip
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible to torch; nothing to measure (skipped).")
        return 0
    where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (dry run)"
    print(f"gpu_check on {where}, torch {torch.__version__}", flush=True)
    print(HEAD, flush=True)
    rows = []
    for mib in args.chunk_mib.split(","):
        for layout_name in args.layouts.split(","):
            rows += measure(int(float(mib) * 2**20), layout_name, args)
            if args.device == "cuda":
                torch.cuda.empty_cache()  # the row's tensors are gone; give their memory back
    print()
    print(table(rows))
    report = {"device": where, "torch": torch.__version__, "rows": rows}
    print(json.dumps(report))
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return 0 if all(r["bit_exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
