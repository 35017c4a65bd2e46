"""Shared fixtures: layouts used across the suite."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvoffload import CacheGroup, KVLayout

#: Real Redis servers on loopback (fixtures ``redis_server``, ``redis_cluster``), and the
#: connector core's harness (fixture ``stand``).
pytest_plugins = ["_redis_servers", "_stand"]

#: The request traces shipped beside the checkout (never copied into it).
TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces"


@pytest.fixture
def hetero_layout() -> KVLayout:
    """The issue's example: a sliding group of 12-token blocks and a full group of 16."""
    swa = CacheGroup(
        kind="sliding",
        tokens_per_block=12,
        layer_names=("l0", "l1"),
        page_bytes=4096,
        sliding_window=64,
    )
    full = CacheGroup(kind="full", tokens_per_block=16, layer_names=("l2",), page_bytes=4096)
    return KVLayout(groups=(swa, full))


@pytest.fixture
def uniform_layout() -> KVLayout:
    return KVLayout(
        groups=(
            CacheGroup(kind="full", tokens_per_block=16, layer_names=("a", "b"), page_bytes=2048),
        )
    )


@pytest.fixture
def rigs() -> Iterator[list[Any]]:
    """The connector rigs a test made (``test_vllm_scheduler.rig``), closed after it."""
    made: list[Any] = []
    yield made
    for rig in made:
        rig.close()
