"""One engine-like process on a shared disk tier, for the multi-process tests.

``python tests/_disk_worker.py ROOT NS_HEX BUDGET WORKER PEERS ROUNDS STORES``

Each round opens a ``DiskTier`` (a restart), stores ``STORES`` chunks of its
own keys and loads every chunk of every worker that the directory shows,
checking each byte; then closes the tier. ``ROUNDS`` 0 means: one round that
runs until stdin is closed (the parent's stop signal). It prints ``owner
<token>`` when a tier opens and ``stored <n>`` after each store, then one JSON
line of totals. A chunk's bytes and size follow from its key alone, so any
process can check what any other stored.
"""

from __future__ import annotations

import json
import select
import sys
from pathlib import Path

import numpy as np

from kvoffload.errors import KVOffloadError
from kvoffload.tiers.disk import DiskTier

#: Chunk payload sizes: around 48 KiB, unaligned, varying with the key.
BASE = 48 << 10


def key_of(worker: int, i: int) -> bytes:
    return (worker * 1_000_000 + i).to_bytes(16, "little")


def size_of(key: bytes) -> int:
    i = int.from_bytes(key, "little")
    return BASE + 4096 * (i % 3) + i % 7


def payload(key: bytes) -> np.ndarray:
    seed = int.from_bytes(key, "little")
    return np.frombuffer(np.random.default_rng(seed).bytes(size_of(key)), np.uint8)


def _stopped() -> bool:
    return bool(select.select([sys.stdin], [], [], 0)[0])


class Worker:
    def __init__(self, root: str, namespace: bytes, budget: int, worker: int, peers: int) -> None:
        self.root, self.namespace, self.budget = root, namespace, budget
        self.worker, self.peers = worker, peers
        self.totals = {"starts": 0, "stores": 0, "peer_loads": 0, "bad_loads": 0}
        self.errors: list[str] = []
        self.stored = 0

    def round(self, stores: int) -> None:
        tier = DiskTier(self.root, self.budget, self.namespace)
        self.totals["starts"] += 1
        print("owner", tier._owner.token, flush=True)  # names its temp files (private)
        try:
            for _ in range(stores or 10**9):
                key = key_of(self.worker, self.stored)
                try:
                    tier.put(key, payload(key))
                except KVOffloadError as exc:  # counted in the tier's stats too
                    self.errors.append(f"store {key.hex()}: {exc}")
                self.stored += 1
                print("stored", self.stored, flush=True)
                self.load_all(tier)
                if not stores and _stopped():
                    break
        finally:
            self.add_stats(tier)
            tier.close()

    def load_all(self, tier: DiskTier) -> None:
        window = range(max(0, self.stored - 4), self.stored + 4)  # peers run at about our pace
        keys = [key_of(w, i) for w in range(self.peers) for i in window]
        for key, there in zip(keys, tier.contains_many(keys), strict=True):
            if not there:
                continue
            out = np.empty(size_of(key), np.uint8)
            try:
                found = tier.get_into(key, out)
            except KVOffloadError as exc:
                self.errors.append(f"load {key.hex()}: {exc}")
                continue
            if found and not np.array_equal(out, payload(key)):
                self.totals["bad_loads"] += 1
            elif found and int.from_bytes(key, "little") // 1_000_000 != self.worker:
                self.totals["peer_loads"] += 1

    def add_stats(self, tier: DiskTier) -> None:
        stats = tier.stats()
        for name in ("stores", "store_failures", "loads", "corrupt", "load_failures", "misses"):
            self.totals[name] = self.totals.get(name, 0) + getattr(stats, name)
        self.totals["stores_done"] = self.stored


def main(argv: list[str]) -> int:
    root, ns_hex, budget, worker, peers, rounds, stores = argv
    run = Worker(root, bytes.fromhex(ns_hex), int(budget), int(worker), int(peers))
    for _ in range(max(int(rounds), 1)):
        run.round(int(stores) if int(rounds) else 0)
    print(json.dumps({**run.totals, "errors": run.errors[:5]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main(sys.argv[1:]))
