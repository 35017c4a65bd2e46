"""Another engine process for the remote-tier tests: stores chunks on a shared server.

``python tests/_remote_child.py URL SEED`` builds an engine with its own CPU
tier and the remote tier, fills its KV blocks from ``SEED`` and stores the
chunks the parent test names (see ``test_remote_tier.CHUNKS``), then exits.
"""

from __future__ import annotations

import sys

import torch

from kvoffload.engine import OffloadEngine
from kvoffload.tiers._write_behind import WriteBehind
from kvoffload.tiers.cascade import TierCascade
from kvoffload.tiers.cpu import CPUSlab
from kvoffload.tiers.remote import RedisTier
from kvoffload.transfer import KVTransfer, allocate_kv_caches, fill_blocks

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from test_remote_tier import BPC, CHUNKS, NAMESPACE, NUM_BLOCKS, layout, store_spans

if __name__ == "__main__":
    url, seed = sys.argv[1], int(sys.argv[2])
    caches = allocate_kv_caches(layout(), NUM_BLOCKS, torch.bfloat16)
    fill_blocks(caches, seed=seed)
    cpu = CPUSlab(16, max(g.chunk_bytes(BPC) for g in layout().groups), pin_memory=False)
    remote = RedisTier(url, NAMESPACE, timeout_ms=2000)
    cascade = TierCascade(cpu, [WriteBehind(remote, 64 << 20)])
    engine = OffloadEngine(KVTransfer(layout(), caches, BPC), cascade)
    engine.submit_store(store_spans(CHUNKS))
    assert engine.wait(timeout=60)
    [result] = engine.get_finished()
    engine.close()
    if result.failed_keys or result.errors:
        raise SystemExit(f"store failed: {result.errors}")
