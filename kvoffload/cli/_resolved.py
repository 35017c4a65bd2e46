"""What ``auto`` becomes on a planned layout: the engine's own choice, said before it starts.

``key_source`` and ``load_in_step`` default to ``auto``, which the connector
resolves at engine start from the layout (and, for keys, vLLM's hash
algorithm). ``plan`` asks the same functions the connector asks, so what it
prints is what the engine will do, with the reason in words; vLLM's default
``sha256`` block hashes are assumed (they agree across processes).
"""

from __future__ import annotations

import math

from kvoffload.config import OffloadConfig
from kvoffload.connector.key_source import choose_engine_hashes
from kvoffload.connector.loads import failures_by_block, loads_in_step
from kvoffload.keys import EngineHashes

__all__ = ["resolved_choices"]


def _key_source(config: OffloadConfig) -> tuple[str, str]:
    layout = config.layout
    engine = EngineHashes(math.gcd(*layout.tokens_per_block), "sha256")
    if choose_engine_hashes(config, engine, reproducible=True) is not None:
        return "engine", "keys chained over vLLM's block hashes, no second hash of the prompt"
    if layout.lookahead:
        return "tokens", "a drafter's KV reads past each chunk, which vLLM's hashes do not name"
    return "tokens", "a chunk does not end on one of vLLM's block hashes"


def _load_in_step(config: OffloadConfig) -> tuple[str, str]:
    layout = config.layout
    if loads_in_step(config, len(layout.groups)):
        return "in_step", "CPU-tier hits load in the step that asks for them"
    assert not failures_by_block(layout, len(layout.groups))  # the rule loads_in_step applies
    return "next_step", (
        "vLLM takes a failed load of this layout only by request (several KV cache groups, "
        "a sliding window or a recurrent state), which a load in the step could not report"
    )


def resolved_choices(config: OffloadConfig) -> dict[str, tuple[str, str]]:
    """Per ``auto`` key: ``(what it becomes, why)``, as the connector will resolve it."""
    choices = {"key_source": _key_source, "load_in_step": _load_in_step}
    return {
        name: resolve(config)
        for name, resolve in choices.items()
        if getattr(config, name) == "auto"
    }
