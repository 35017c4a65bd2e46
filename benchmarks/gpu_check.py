"""GPU check: device<->host GB/s of kvoffload's transfer paths against a plain pinned ``copy_``.

For each chunk size and engine tensor layout it builds a synthetic model
(``--layers`` layers, 4 blocks per chunk, 16 tokens per block), then for each
``--models`` entry the layout ``kvoffload plan`` gives that bundled example
(DeepSeek-V4 with FlashMLA's fp8 cache: six groups, pages of 2 to 64 KiB;
Gemma-4: four groups of 64 KiB pages; ``--model-bpc`` blocks per chunk, every
group's chunks in a job), a pinned :class:`~kvoffload.tiers.cpu.CPUSlab`, and
moves ``--total-mib`` of KV by each of ``--paths``:

* **staged** (the connector's default): :class:`~kvoffload.transfer.KVTransfer`
  on CUDA, through device staging (one kernel per layer, one DMA per chunk);
* **direct**: the same calls with ``staged=False``, straight strided copies
  between the engine tensors and host memory, the first CUDA path;
* **kernel**: ``kernel="always"``, one Triton launch per call for all its
  layers and chunks, reading and writing the pinned slab directly;
* **auto**: ``kernel="auto"``, kernel or staged DMA per group, direction and
  call size as a calibration at construction measured faster (it logs its table);
* **engine** / **engine-kernel**: the worker's
  :class:`~kvoffload.engine.OffloadEngine` (two job threads, a stream each, slab
  bookkeeping) on the staged path / the kernel, store jobs then load jobs: its
  rate against the bare calls' is the engine's overhead.

Store (D2H) ``gather``\\s engine blocks into slab slots, ``--chunks-per-job``
chunks a call, as the engine's store jobs do; load (H2D) ``scatter``\\s them
back. Layouts: FlashAttention's ``[2, num_blocks, ...]`` (``kv_first``) and
FlashInfer's / the CPU backend's ``[num_blocks, 2, ...]`` (``block_first``);
the models' pages are block-first. Rows come for consecutive block ids and
shuffled ones. The reference is one ``copy_`` of a contiguous CUDA buffer of
the same size to and from a pinned host buffer, measured in the same run.
Every path's round trip of one job is checked bit-exact, the engine's of every job.

Run: ``python benchmarks/gpu_check.py [--chunk-mib 1,4,16] [--total-mib 1024]
[--paths ...] [--models ...] [--json-out FILE]``. Prints a table, then one JSON
object. Without CUDA it prints why and exits 0, so it is safe anywhere;
``--device cpu`` dry-runs the paths on host tensors (the kernel then runs in
Triton's interpreter: keep ``--total-mib`` tiny). Exit 1 if a round trip was
not bit-exact.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import torch

from kvoffload.cli.plan import example_path
from kvoffload.config.hf_layout import layout_from_hf_config
from kvoffload.config.layout import CacheGroup, KVLayout
from kvoffload.engine import ChunkSpan, JobStatus, OffloadEngine
from kvoffload.messages import BlockSpan
from kvoffload.tiers.cpu import CPUSlab
from kvoffload.transfer import KVTransfer, allocate_kv_caches, fill_blocks
from kvoffload.transfer.synthetic import EngineLayout

BLOCKS_PER_CHUNK, TOKENS_PER_BLOCK = 4, 16
LAYOUTS = {"kv_first": EngineLayout.KV_FIRST, "block_first": EngineLayout.BLOCK_FIRST}
#: --paths: what each transfer row passes to KVTransfer (engine rows: the engine's transfer).
TRANSFER_PATHS = {
    "staged": {"staged": True}, "direct": {"staged": False},
    "kernel": {"kernel": "always"}, "auto": {"kernel": "auto"},
    "engine": {}, "engine-kernel": {"kernel": "always"},
}  # fmt: skip
#: The DeepSeek-V4 (FlashMLA's fp8 cache: pages of 2 to 64 KiB in one group) and Gemma-4
#: layouts of the bundled examples, as `kvoffload plan` lays them out.
MODELS = "tiny_deepseek_v4:fp8_ds_mla,tiny_gemma4:bfloat16"
Job = list[tuple[int, range, BlockSpan]]  # (group, slab slots, engine blocks) per group


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


def make_jobs(layout: KVLayout, bpc: int, chunks: int, per_job: int, shuffled: bool) -> list[Job]:
    """Jobs of ``per_job`` chunks of every group, each group in slots of its own."""
    jobs: list[Job] = [[] for _ in range(0, chunks, per_job)]
    for g, group in enumerate(layout.groups):
        blocks = group.chunk_blocks(bpc)
        ids = torch.randperm(chunks * blocks).tolist() if shuffled else range(chunks * blocks)
        for j, first in enumerate(range(0, chunks, per_job)):
            slots = range(g * chunks + first, g * chunks + min(first + per_job, chunks))
            span = ids[first * blocks : (first + len(slots)) * blocks]
            jobs[j].append((g, slots, BlockSpan(tuple(span))))
    return jobs


def planned_caches(layout: KVLayout, bpc: int, chunks: int, device: str) -> dict[str, torch.Tensor]:
    """Random block-first pages of each layer's own size, as ``kvoffload plan`` gives them."""
    caches = {}
    for group in layout.groups:
        blocks = chunks * group.chunk_blocks(bpc)
        for name, page in zip(group.layer_names, group.layer_pages, strict=True):
            caches[name] = torch.randint(0, 256, (blocks, page), dtype=torch.uint8, device=device)
    return caches


class Setup:
    """One layout: engine tensors, a pinned slab with slots per group, the jobs' geometry."""

    def __init__(  # noqa: PLR0917 - called by the two constructors below
        self, label: str, layout: KVLayout, bpc: int, chunks: int, args: argparse.Namespace,
        caches: dict[str, torch.Tensor],
    ) -> None:  # fmt: skip
        self.label, self.layout, self.bpc, self.chunks = label, layout, bpc, chunks
        self.caches = caches
        self.sizes = [g.chunk_bytes(bpc) for g in layout.groups]
        self.chunk_bytes = sum(self.sizes)  # one chunk of every group
        self.nbytes = chunks * self.chunk_bytes
        self.pinned = args.device == "cuda"
        self.tier = CPUSlab(chunks * len(self.sizes), max(self.sizes), pin_memory=self.pinned)
        self.args = args

    @classmethod
    def synthetic(cls, chunk_bytes: int, layout_name: str, args: argparse.Namespace) -> Setup:
        layout = model(chunk_bytes, args.layers)
        chunks = max(args.chunks_per_job, int(args.total_mib * 2**20) // chunk_bytes)
        caches = allocate_kv_caches(
            layout, chunks * BLOCKS_PER_CHUNK, torch.bfloat16, LAYOUTS[layout_name],
            device=args.device,
        )  # fmt: skip
        fill_blocks(caches)
        return cls(layout_name, layout, BLOCKS_PER_CHUNK, chunks, args, caches)

    @classmethod
    def planned(cls, spec: str, args: argparse.Namespace) -> Setup:
        """``NAME:DTYPE``: a bundled example's layout from ``kvoffload plan``."""
        name, _, dtype = spec.partition(":")
        layout = layout_from_hf_config(example_path(name), dtype or "bfloat16")
        bpc = args.model_bpc
        per_chunk = sum(g.chunk_bytes(bpc) for g in layout.groups)
        chunks = max(args.chunks_per_job, int(args.total_mib * 2**20) // per_chunk)
        caches = planned_caches(layout, bpc, chunks, args.device)
        return cls(spec, layout, bpc, chunks, args, caches)

    def row(self, ids: str, path: str, d2h: float, h2d: float, exact: bool) -> dict[str, Any]:
        return {
            "chunk_bytes": self.chunk_bytes, "layout": self.label, "block_ids": ids,
            "path": path, "d2h_gbps": d2h, "h2d_gbps": h2d, "bit_exact": exact,
        }  # fmt: skip

    def buffers(self, slots: range, group: int) -> list[torch.Tensor]:
        return [self.tier.slot(s, self.sizes[group]) for s in slots]

    def transfer_row(self, shuffled: bool, path: str) -> dict[str, Any]:
        """``gather`` / ``scatter`` calls on the calling thread, one job's chunks a call."""
        kwargs: Any = TRANSFER_PATHS[path]
        transfer = KVTransfer(self.layout, self.caches, self.bpc, **kwargs)
        jobs = make_jobs(self.layout, self.bpc, self.chunks, self.args.chunks_per_job, shuffled)

        def store() -> None:
            for job in jobs:
                for g, slots, span in job:
                    transfer.gather(g, span, self.buffers(slots, g))

        def load() -> None:
            for job in jobs:
                for g, slots, span in job:
                    transfer.scatter(g, span, self.buffers(slots, g))

        d2h = timed(self.nbytes, store, self.args.repeat)
        h2d = timed(self.nbytes, load, self.args.repeat)
        exact = self.round_trip(transfer, jobs[0])
        return self.row("shuffled" if shuffled else "consecutive", path, d2h, h2d, exact)

    def round_trip(self, transfer: KVTransfer, job: Job) -> bool:
        """Gather one job, zero its blocks on the device, scatter back: equal to the original?"""
        exact = True
        for g, slots, span in job:
            index = torch.tensor(span.block_ids, device=transfer.device)
            pages = [(p.pages, 1 if p.split.value == "kv_first" else 0) for p in transfer.groups[g]]
            before = [t.index_select(dim, index).clone() for t, dim in pages]
            transfer.gather(g, span, self.buffers(slots, g))
            for t, dim in pages:
                t.index_fill_(dim, index, 0)
            transfer.scatter(g, span, self.buffers(slots, g))
            synchronize()
            exact &= all(torch.equal(t.index_select(dim, index), b)
                         for (t, dim), b in zip(pages, before, strict=True))  # fmt: skip
        return exact

    def engine_row(self, shuffled: bool, path: str) -> dict[str, Any]:
        """Store jobs, then load jobs, through the worker's engine (the connector's path)."""
        kwargs: Any = TRANSFER_PATHS[path]
        transfer = KVTransfer(self.layout, self.caches, self.bpc, **kwargs)
        engine = OffloadEngine.create(transfer, self.tier, max_workers=2)
        jobs = make_jobs(self.layout, self.bpc, self.chunks, self.args.chunks_per_job, shuffled)
        spans = [
            [ChunkSpan(g, tuple(b"k%d" % s for s in slots), tuple(slots), span)
             for g, slots, span in job]
            for job in jobs
        ]  # fmt: skip
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
        return self.row("shuffled" if shuffled else "consecutive", path, d2h, h2d, ok)


def measure(setup: Setup, args: argparse.Namespace) -> list[dict[str, Any]]:
    ref_d2h, ref_h2d = reference(setup.nbytes, args.repeat, args.device)
    rows = []
    for shuffled in (False, True):
        for path in args.paths.split(","):
            if path.startswith("engine"):
                rows.append(setup.engine_row(shuffled, path))
            else:
                rows.append(setup.transfer_row(shuffled, path))
            print(table(rows[-1:], header=False, ref=(ref_d2h, ref_h2d)), flush=True)
    for row in rows:
        row.update(ref_d2h_gbps=ref_d2h, ref_h2d_gbps=ref_h2d)
    return rows


HEAD = (
    f"{'chunk':>9} {'layout':>26} {'blocks':>11} {'path':>13} | {'D2H':>6} {'ref':>6} "
    f"{'ratio':>6} | {'H2D':>6} {'ref':>6} {'ratio':>6} | exact"
)


def table(
    rows: list[dict[str, Any]], header: bool = True, ref: tuple[float, float] | None = None
) -> str:
    lines = [HEAD, "-" * len(HEAD)] if header else []
    for r in rows:
        rd, rh = ref or (r["ref_d2h_gbps"], r["ref_h2d_gbps"])
        lines.append(
            f"{r['chunk_bytes'] / 2**20:>5.2f} MiB {r['layout']:>26} {r['block_ids']:>11} "
            f"{r['path']:>13} | {r['d2h_gbps']:>6.2f} {rd:>6.2f} {r['d2h_gbps'] / rd:>6.0%} | "
            f"{r['h2d_gbps']:>6.2f} {rh:>6.2f} {r['h2d_gbps'] / rh:>6.0%} | {r['bit_exact']}"
        )
    return "\n".join(lines)


def setups(args: argparse.Namespace) -> Iterator[Setup]:
    """The synthetic chunk sizes and layouts, then the planned models (built one at a time)."""
    for mib in filter(None, args.chunk_mib.split(",")):
        for layout_name in filter(None, args.layouts.split(",")):
            yield Setup.synthetic(int(float(mib) * 2**20), layout_name, args)
    for spec in filter(None, args.models.split(",")):
        yield Setup.planned(spec, args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunk-mib", default="1,4,16")
    parser.add_argument("--layouts", default="kv_first,block_first")
    parser.add_argument(
        "--paths",
        default=None,
        help=f"of {', '.join(TRANSFER_PATHS)} (default: all; with --device cpu "
        "staged,direct,engine, as the kernel runs in Triton's interpreter there)",
    )
    parser.add_argument(
        "--models",
        default=None,
        help="bundled examples as NAME:DTYPE, laid out as `kvoffload plan` does "
        f"(default {MODELS}; none with --device cpu)",
    )
    parser.add_argument("--model-bpc", type=int, default=8,
                        help="blocks per chunk of the --models rows")  # fmt: skip
    parser.add_argument("--total-mib", type=float, default=1024.0)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--chunks-per-job", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json-out", type=Path, default=None)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: dry-run the paths on host tensors")  # fmt: skip
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # auto's calibration table
    on_cpu = args.device == "cpu"
    if args.paths is None:
        args.paths = "staged,direct,engine" if on_cpu else ",".join(TRANSFER_PATHS)
    if args.models is None:
        args.models = "" if on_cpu else MODELS
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible to torch; nothing to measure (skipped).")
        return 0
    where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (dry run)"
    print(f"gpu_check on {where}, torch {torch.__version__}", flush=True)
    print(HEAD, flush=True)
    unknown = set(args.paths.split(",")) - set(TRANSFER_PATHS)
    if unknown:
        parser.error(f"unknown --paths {sorted(unknown)}; choose from {', '.join(TRANSFER_PATHS)}")
    rows = []
    for setup in setups(args):
        rows += measure(setup, args)
        del setup
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
