"""Every tier keeps tenants apart: a salted chunk is a hit for its own salt only.

The connector's scheduler and worker sides run on real parts (the package's
stand-in plays vLLM, through ``test_vllm_scheduler``'s rig): the CPU tier in one process, and the
disk tier (real files) and the remote tier (a real Redis server on loopback)
read by a second engine with an empty CPU tier, as after a restart or on
another machine. Another salt, no salt, or the same salt with a LoRA adapter
must miss; the owner must hit, with its KV loaded bit-exact.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_vllm_scheduler import Rig, llama_like, tokens

from kvoffload.keys import KeyExtras

ALICE = KeyExtras(salt="alice")
OTHERS = {
    "another salt": KeyExtras(salt="bob"),
    "no salt": None,
    "an adapter": KeyExtras(salt="alice", adapter=b"\x01" * 16),
}


def tier_settings(tier: str, tmp_path: Path, request: pytest.FixtureRequest) -> dict[str, Any]:
    if tier == "redis":
        server = request.getfixturevalue("redis_server")
        return {"remote_url": server.url, "remote_timeout_ms": 5000}
    return {}


@pytest.mark.parametrize("tier", ["cpu", "disk", "redis"])
def test_a_salted_chunk_is_a_hit_for_its_own_salt_only(
    tier: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    settings = tier_settings(tier, tmp_path, request)
    disk = tmp_path / "kv" if tier == "disk" else None
    ids = tokens(70)
    writer = Rig(llama_like(), disk, **settings)
    writer.serve("alice-1", ids, extras=ALICE)
    if tier == "cpu":
        reader = writer
    else:  # a new engine: an empty CPU tier, the lower tier as the writer left it
        writer.close()
        reader = Rig(llama_like(), disk, probes=True, **settings)
    sched = reader.scheduler
    for name, extras in OTHERS.items():
        assert reader.lookup(f"other-{name}", ids, 0, extras) == 0, name
        sched.request_finished(f"other-{name}")
    served = reader.serve("alice-2", ids, extras=ALICE)
    assert served.offered == served.loaded == reader.top_hit(70) > 0
    assert served.mismatched == 0 and served.verified > 0
    figures = sched.stats()
    assert figures["hit_tokens"] == served.offered  # the misses above offered nothing
    assert (
        figures["hit_tokens_by_tier"] == figures["loaded_tokens_by_tier"] == {tier: served.offered}
    )
    if tier == "cpu":
        assert figures["cpu_hit_chunks"] > 0 and figures["lower_hit_chunks"] == 0
    else:
        assert figures["lower_hit_chunks"] > 0 and figures["cpu_hit_chunks"] == 0
        assert reader.worker.engine.stats()[tier].loads == figures["lower_hit_chunks"]
    reader.close()


def test_two_tenants_keep_separate_copies_on_disk(tmp_path: Path) -> None:
    """The same prompt under two salts is two sets of chunk files; each reads its own."""
    ids = tokens(70)
    writer = Rig(llama_like(), tmp_path)
    writer.serve("a", ids, extras=ALICE)
    files_alice = set(tmp_path.rglob("*.kv"))
    writer.serve("b", ids, extras=KeyExtras(salt="bob"))
    files_both = set(tmp_path.rglob("*.kv"))
    writer.close()
    assert files_alice and len(files_both) == 2 * len(files_alice)
    for path in files_both - files_alice:  # damage bob's copy only
        with path.open("r+b") as f:
            f.seek(4096 + 10)
            f.write(b"\x00\xff" * 8)
    reader = Rig(llama_like(), tmp_path, probes=True)
    served = reader.serve("a2", ids, extras=ALICE)
    assert served.offered == served.loaded == reader.top_hit(70) and served.mismatched == 0
    bob = reader.serve("b2", ids, extras=KeyExtras(salt="bob"))
    # bob's damaged files are refused, never alice's handed over
    assert bob.offered == bob.failed > 0 and bob.loaded == 0 and bob.mismatched == 0
    reader.close()
