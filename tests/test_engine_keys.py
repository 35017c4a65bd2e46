"""Keys from the engine's block hashes: what they name, when the connector uses them.

``key_source`` decides whether chunk keys are hashed from token ids or chained
over vLLM's own block hashes (``kvoffload.keys.extend_engine_keys``). The
second is the default wherever it is as good as the first; these tests pin
what "as good" means and that a replay serves the same hits either way.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import pytest

from kvoffload import build_offloading_config
from kvoffload.config.layout import CacheGroup, KVLayout
from kvoffload.connector.key_source import choose_engine_hashes
from kvoffload.connector.scheduler import OffloadScheduler
from kvoffload.errors import ConfigError, ProtocolError
from kvoffload.keys import (
    EngineHashes,
    KeyExtras,
    MMItem,
    extend_engine_keys,
    prefix_keys,
)
from kvoffload.replay import load_trace
from kvoffload.replay.engine import EngineSettings, replay_engine, trace_layout
from kvoffload.vllm._key_source import vllm_hashes_reproducible

ENGINE = EngineHashes(16, "sha256")
CONVERSATION = "tests/data/mooncake_conversation_3000.jsonl"


def block_hashes(tokens: list[int], size: int = 16, salt: bytes = b"") -> list[bytes]:
    """A chain of sha256 hashes, one per ``size`` tokens, as vLLM's ``request.block_hashes``."""
    out, parent = [], salt
    for lo in range(0, len(tokens) - size + 1, size):
        parent = hashlib.sha256(parent + repr(tokens[lo : lo + size]).encode()).digest()
        out.append(parent)
    return out


def engine_keys(hashes: list[bytes], span: int = 32, **kwargs: Any) -> list[bytes]:
    return extend_engine_keys([], hashes, span, engine=kwargs.pop("engine", ENGINE),
                              stop=kwargs.pop("stop", 1 << 30), **kwargs)  # fmt: skip


# -- the keys --------------------------------------------------------------------------------
def test_one_key_per_chunk_the_hashes_cover_and_growth_extends_them() -> None:
    hashes = block_hashes(list(range(200)))  # 12 full blocks of 16: 6 chunks of 32
    keys = engine_keys(hashes)
    assert len(keys) == 6 and len(set(keys)) == 6 and all(len(k) == 16 for k in keys)
    head = engine_keys(hashes, stop=100)  # 3 full chunks below token 100
    assert head == keys[:3]
    rest = extend_engine_keys(head, hashes, 32, engine=ENGINE, stop=200)
    assert head + rest == keys
    # Chunks past the hashes given get no key yet; nothing past the stop either.
    assert engine_keys(hashes[:5]) == keys[:2]
    assert extend_engine_keys(keys, hashes, 32, engine=ENGINE, stop=200) == []


def test_a_key_names_its_whole_prefix_through_the_engine_hash_at_its_end() -> None:
    a, b = list(range(64)), list(range(64))
    b[40] = 999  # inside chunk 1: chunk 0 is shared, chunk 1 is not
    ka, kb = engine_keys(block_hashes(a)), engine_keys(block_hashes(b))
    assert ka[0] == kb[0] and ka[1] != kb[1]
    # Only the hash at a chunk's end is read: a different hash inside the chunk, same end,
    # is the same key (vLLM's hash at the end already names every token before it).
    hashes = block_hashes(a)
    inner = [b"x" * 32, *hashes[1:]]
    assert engine_keys(inner)[0] == ka[0]


def test_group_namespace_algorithm_and_extras_all_separate_keys() -> None:
    hashes = block_hashes(list(range(64)))
    base = engine_keys(hashes)
    variants = [
        engine_keys(hashes, group_idx=1),
        engine_keys(hashes, namespace=b"another model"),
        engine_keys(hashes, engine=EngineHashes(16, "sha256_cbor")),
        engine_keys(hashes, extras=KeyExtras(salt="tenant-a")),
        engine_keys(hashes, extras=KeyExtras(adapter=b"\x01" * 16)),
        engine_keys(hashes, span=16)[1::2],
    ]
    seen = {tuple(base)}
    for keys in variants:
        assert tuple(keys) not in seen
        seen.add(tuple(keys))
    # A multimodal item goes into the chunks it covers, and on down the chain.
    mm = engine_keys(hashes, extras=KeyExtras(mm=(MMItem("img", 40, 8),)))
    assert mm[0] == base[0] and mm[1] != base[1]


def test_engine_keys_never_equal_token_keys() -> None:
    tokens = list(range(64))
    assert set(engine_keys(block_hashes(tokens))).isdisjoint(prefix_keys(tokens, 32))


def test_bad_spans_and_hashes_are_refused_by_name() -> None:
    hashes = block_hashes(list(range(64)))
    with pytest.raises(ConfigError, match="does not end on the engine's block hashes"):
        engine_keys(hashes, span=24)
    with pytest.raises(ConfigError, match="block hashes must be bytes, got str"):
        engine_keys([h.hex() for h in hashes])  # type: ignore[misc]
    with pytest.raises(ConfigError, match="block_size"):
        EngineHashes(0, "sha256")
    with pytest.raises(ConfigError, match="algorithm"):
        EngineHashes(16, "")


# -- which keys the connector makes ------------------------------------------------------------
def config(**extra: Any) -> Any:
    layout = KVLayout((CacheGroup("full", 16, ("l0",), 64),))
    return build_offloading_config({"cpu_bytes_to_use": "1MiB", **extra}, layout)


def test_key_source_is_a_checked_key_with_auto_by_default() -> None:
    assert config().key_source == "auto"
    assert config(key_source="Tokens").key_source == "tokens"
    assert "key_source" in str(config())
    with pytest.raises(ConfigError, match=r"'key_source'.*'auto' or 'tokens' or 'engine'"):
        config(key_source="hashes")


@pytest.mark.parametrize(
    ("extra", "reproducible", "engine"),
    [
        ({}, True, True),
        ({}, False, True),  # nothing outlives the process: per-process hashes do
        ({"disk_path": "/tmp/x", "disk_bytes_to_use": "1MiB"}, True, True),
        ({"disk_path": "/tmp/x", "disk_bytes_to_use": "1MiB"}, False, False),
        ({"remote_url": "redis://127.0.0.1:6379/0"}, False, False),
        ({"key_source": "tokens"}, True, False),
        ({"key_source": "engine", "remote_url": "redis://127.0.0.1:6379/0"}, False, True),
    ],
)
def test_auto_takes_engine_keys_where_they_lose_nothing(
    extra: dict[str, Any], reproducible: bool, engine: bool
) -> None:
    chosen = choose_engine_hashes(config(**extra), ENGINE, reproducible=reproducible)
    assert chosen == (ENGINE if engine else None)


def test_auto_falls_back_to_tokens_where_chunks_miss_the_hashes() -> None:
    assert choose_engine_hashes(config(), EngineHashes(12, "sha256"), reproducible=True) is None
    with pytest.raises(ConfigError, match="key_source='tokens'"):
        choose_engine_hashes(
            config(key_source="engine"), EngineHashes(12, "sha256"), reproducible=True
        )


def test_engine_keys_a_disk_cannot_share_are_warned_about(
    caplog: pytest.LogCaptureFixture,
) -> None:
    disk = {"disk_path": "/tmp/x", "disk_bytes_to_use": "1MiB", "key_source": "engine"}
    with caplog.at_level(logging.WARNING, logger="kvoffload"):
        choose_engine_hashes(config(**disk), EngineHashes(16, "xxhash"), reproducible=False)
    assert "PYTHONHASHSEED" in caplog.text and "xxhash" in caplog.text


def test_which_vllm_hashes_are_the_same_in_every_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert vllm_hashes_reproducible("sha256") and vllm_hashes_reproducible("sha256_cbor")
    assert not vllm_hashes_reproducible("xxhash") and not vllm_hashes_reproducible("xxhash_cbor")
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    assert vllm_hashes_reproducible("xxhash")


def test_a_scheduler_on_engine_keys_needs_the_hashes() -> None:
    scheduler = OffloadScheduler(config(), b"ns", engine_hashes=ENGINE)
    with pytest.raises(ProtocolError, match="block_hashes"):
        scheduler.lookup("r", list(range(64)), 0)
    assert scheduler.lookup("r", list(range(64)), 0, None, block_hashes(list(range(64)))) == 0
    assert [len(k) for k in scheduler.requests.open("r").keys] == [3]  # 63 tokens keyed: 3 chunks
    with pytest.raises(ConfigError, match="does not end on the engine's block hashes"):
        OffloadScheduler(config(), b"ns", engine_hashes=EngineHashes(12, "sha256"))


def test_a_replay_hits_alike_on_engine_and_token_keys() -> None:
    # LRU decides by order alone, so both key sources must load exactly the same tokens;
    # the default policy samples its shadows by key bytes, so it may differ a little.
    trace = load_trace(CONVERSATION, limit=600)
    settings = EngineSettings(gpu_blocks=300)
    rows = {}
    for source in ("engine", "tokens"):
        layout = trace_layout()
        rows[source] = replay_engine(trace, 1000, "lru", layout=layout, settings=settings,
                                     key_source=source)  # fmt: skip
    a, b = rows["engine"], rows["tokens"]
    assert a.loaded_tokens == b.loaded_tokens > 0
    assert (a.gpu_hit_tokens, a.steps) == (b.gpu_hit_tokens, b.steps)
