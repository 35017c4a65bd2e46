"""Microseconds per disk tier call: what sharing a ``disk_path`` costs a store and a lookup.

``kvoffload bench --tier disk`` measures GB/s at real chunk sizes, where a
store's cost is mostly the write. This measures the calls themselves, with
small chunks (4 KiB by default) so the per-call work shows:

* ``store_us`` / ``load_us``: ``DiskTier.put`` / ``get_into`` per chunk;
* ``tier_lookup_us``, ``probe_lookup_us``: ``DiskTier.contains_many`` and
  ``DiskProbe.contains_many`` per key (every key held), against ``stat_us``, a
  plain ``os.stat`` of each chunk file's path;
* with ``--processes N``, ``shared_store_us``: the mean time of a store while
  N processes store into the same directory at once (each its own keys).

It uses only the tier's public calls, so it runs against any checkout, e.g.
``PYTHONPATH=/path/to/other/checkout python benchmarks/disk_calls.py``, to
compare two versions in the same conditions. Each figure is the best of
``--repeat`` rounds. Run: ``python benchmarks/disk_calls.py [--dir DIR]
[--chunk-bytes 4096] [--keys 256] [--processes 4] [--repeat 5]``; prints one
JSON object.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import kvoffload
from kvoffload.bench.local import tier_calls
from kvoffload.tiers.disk import DiskProbe, DiskTier

NAMESPACE = b"\x07" * 16


def best_us(fn: Callable[[], None], calls: int, repeat: int) -> float:
    """The fastest of ``repeat`` runs of ``fn``, in microseconds per call."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def single_process(root: Path, args: argparse.Namespace) -> dict[str, float]:
    tier = DiskTier(root, 1 << 30, NAMESPACE)
    keys = [i.to_bytes(16, "little") for i in range(args.keys)]
    data = np.frombuffer(np.random.default_rng(0).bytes(args.chunk_bytes), np.uint8)
    out = np.empty_like(data)
    probe = DiskProbe(root, NAMESPACE)
    paths = [str(root / NAMESPACE.hex() / f"{key.hex()}.kv") for key in keys]

    store, load = tier_calls(tier, keys, data, out)

    def stat() -> None:
        for path in paths:
            os.stat(path)

    figures = {
        "store_us": best_us(store, len(keys), args.repeat),
        "load_us": best_us(load, len(keys), args.repeat),
        "tier_lookup_us": best_us(lambda: tier.contains_many(keys), len(keys), 4 * args.repeat),
        "probe_lookup_us": best_us(lambda: probe.contains_many(keys), len(keys), 4 * args.repeat),
        "stat_us": best_us(stat, len(keys), 4 * args.repeat),
    }
    if not all(probe.contains_many(keys)):
        raise SystemExit("a stored chunk was not found by the probe")
    tier.close()
    return figures


def _store_worker(root: str, worker: int, args: argparse.Namespace, start: Any) -> float:
    tier = DiskTier(root, 1 << 30, NAMESPACE)
    data = np.frombuffer(np.random.default_rng(worker).bytes(args.chunk_bytes), np.uint8)
    keys = [(worker << 32 | i).to_bytes(16, "little") for i in range(args.keys)]
    start.wait()
    began = time.perf_counter()
    for key in keys:
        tier.put(key, data)
    elapsed = time.perf_counter() - began
    tier.close()
    return elapsed / len(keys) * 1e6


def shared_store_us(root: Path, args: argparse.Namespace) -> float:
    """Mean microseconds per store while ``args.processes`` processes store at once."""
    best = float("inf")
    for round_ in range(args.repeat):
        directory = root / f"shared{round_}"
        with multiprocessing.Manager() as manager:
            start = manager.Barrier(args.processes)
            with multiprocessing.Pool(args.processes) as pool:
                jobs = [
                    pool.apply_async(_store_worker, (str(directory), w, args, start))
                    for w in range(args.processes)
                ]
                best = min(best, sum(job.get() for job in jobs) / len(jobs))
        shutil.rmtree(directory)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="parent of the scratch directory")
    parser.add_argument("--chunk-bytes", type=int, default=4096)
    parser.add_argument("--keys", type=int, default=256)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="kvoffload-calls-", dir=args.dir))
    try:
        figures: dict[str, Any] = {"kvoffload": str(Path(kvoffload.__file__).parents[1])}
        figures.update(single_process(root / "single", args))
        if args.processes > 1:
            figures[f"shared_store_us_{args.processes}p"] = shared_store_us(root, args)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
