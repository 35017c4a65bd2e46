"""Key cards: a prefill and a decode engine that would name chunks differently are told so at
start, with the setting that differs, instead of missing every lookup in silence.

Cards on a real disk and a real Redis server on loopback.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
from _redis_servers import RedisServer

from kvoffload import build_offloading_config
from kvoffload.config.layout import CacheGroup, KVLayout
from kvoffload.keys.identity import KeyIdentity
from kvoffload.tiers.cards import CARD_MAX_AGE_S, exchange_cards, key_mismatch
from kvoffload.tiers.handoff import HANDOFF_DIR

LAYOUT = KVLayout((CacheGroup("full", 16, ("l0",), 512),))
PRODUCER = KeyIdentity(
    role="kv_producer",
    model="/models/llama",
    dtype="bfloat16",
    world_size=2,
    sharded=True,
    groups=("full 16 tokens/block 512 B/page",),
    tokens_per_chunk=(32,),
    key_source="token ids",
    namespaces=("aa", "bb"),
    where="host-a pid 1",
    written_at=1000.0,
)
CONSUMER = dataclasses.replace(PRODUCER, role="kv_consumer", where="host-b pid 2")


def test_engines_that_name_chunks_alike_are_not_warned() -> None:
    assert key_mismatch(CONSUMER, [PRODUCER], now=1010.0) is None
    assert key_mismatch(PRODUCER, [CONSUMER], now=1010.0) is None
    assert key_mismatch(CONSUMER, [], now=1010.0) is None  # no producer yet: nothing to say


MISMATCHES = [
    ({"tokens_per_chunk": (64,)}, "[64] tokens per chunk where this engine has [32] "
     "(kvoffload's blocks_per_chunk or block_size)"),
    ({"world_size": 1, "sharded": False, "namespaces": ("cc",)},
     "tensor_parallel_size 1 where this engine has 2: this model's KV is split across ranks"),
    ({"key_source": "vLLM's sha256 block hashes per 16 tokens, seed PYTHONHASHSEED 1a2b3c4d"},
     "(key_source, vLLM's prefix_caching_hash_algo, or PYTHONHASHSEED)"),
    ({"model": "/mnt/llama", "namespaces": ("cc", "dd")},
     "model '/mnt/llama' where this engine has '/models/llama' (the model's path or name"),
    ({"groups": ("full 16 tokens/block 256 B/page",), "namespaces": ("cc", "dd")},
     "(block_size or kv_cache_dtype)"),
    ({"namespaces": ("cc", "dd")}, "another KV layout (the layers' names or page format"),
]  # fmt: skip


@pytest.mark.parametrize(("change", "named"), MISMATCHES)
def test_a_mismatch_is_named_with_the_setting_to_change(
    change: dict[str, object], named: str
) -> None:
    producer = dataclasses.replace(PRODUCER, **change)  # type: ignore[arg-type]
    warning = key_mismatch(CONSUMER, [producer], now=1012.0)
    assert warning is not None
    assert warning.startswith(
        "kvoffload: this kv_consumer names chunks unlike every kv_producer that left a card "
        "on the shared tier, so its lookups miss what they store: the newest (host-a pid 1, "
        "12 s ago) has "
    )
    assert named in warning and "\n" not in warning


def test_an_mla_model_may_mix_tensor_parallel_sizes() -> None:
    replicated = dataclasses.replace(PRODUCER, sharded=False, namespaces=("aa",))
    consumer = dataclasses.replace(replicated, role="kv_consumer", world_size=1)
    assert key_mismatch(consumer, [replicated], now=1010.0) is None


def test_one_matching_peer_is_enough_and_old_or_same_role_cards_do_not_count() -> None:
    other = dataclasses.replace(PRODUCER, tokens_per_chunk=(64,), written_at=1005.0)
    assert key_mismatch(CONSUMER, [other, PRODUCER], now=1010.0) is None
    stale = dataclasses.replace(other, written_at=1010.0 - CARD_MAX_AGE_S - 1)
    assert key_mismatch(CONSUMER, [stale], now=1010.0) is None
    twin = dataclasses.replace(CONSUMER, tokens_per_chunk=(64,))
    assert key_mismatch(CONSUMER, [twin], now=1010.0) is None
    warning = key_mismatch(PRODUCER, [twin], now=1010.0)
    assert warning is not None and "so they will not find what it stores" in warning


def test_a_card_reads_back_as_written_and_junk_is_no_card() -> None:
    assert KeyIdentity.from_json(PRODUCER.to_json()) == PRODUCER
    assert KeyIdentity.from_json("{}") is None and KeyIdentity.from_json(b"\xff") is None


def split(role: str, tmp_path: Path, **extra: object) -> object:
    keys = {"cpu_bytes_to_use": "8MiB", **extra}
    return build_offloading_config(keys, LAYOUT, kv_role=role)


def test_cards_on_a_shared_disk(tmp_path: Path) -> None:
    disk = {"disk_path": str(tmp_path / "kv"), "disk_bytes_to_use": "64MiB"}
    assert exchange_cards(split("kv_producer", tmp_path, **disk), PRODUCER) is None
    cards = tmp_path / "kv" / HANDOFF_DIR / "cards"
    assert len(list(cards.glob("kv_producer-*.json"))) == 1
    (cards / "junk.json").write_text("not a card")
    consumer = split("kv_consumer", tmp_path, **disk)
    assert exchange_cards(consumer, CONSUMER) is None
    other = dataclasses.replace(CONSUMER, tokens_per_chunk=(64,))
    warning = exchange_cards(consumer, other)
    assert warning is not None and "[32] tokens per chunk where this engine has [64]" in warning
    assert f"pid {os.getpid()}" in warning  # the producer's card, stamped when written


def test_cards_on_a_shared_redis_server(redis_server: RedisServer, tmp_path: Path) -> None:
    remote = {"remote_url": redis_server.url}
    assert exchange_cards(split("kv_producer", tmp_path, **remote), PRODUCER) is None
    assert len(redis_server.client().hvals("kvoffload:cards")) == 1
    consumer = split("kv_consumer", tmp_path, **remote)
    other = dataclasses.replace(CONSUMER, world_size=1, namespaces=("cc",))
    warning = exchange_cards(consumer, other)
    assert warning is not None and "tensor_parallel_size 2 where this engine has 1" in warning
    redis_server.kill()  # down: nothing to compare, nothing raised
    assert exchange_cards(consumer, other) is None
