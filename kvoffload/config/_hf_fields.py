"""Integer fields of a Hugging Face ``config.json``, checked once for every model family."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvoffload._checks import checked_int

__all__ = ["MAX_LAYERS", "int_field", "layer_count"]

#: Most decoder layers a config may declare: far above any published model (the deepest
#: have a few hundred), far below a count that would take minutes to lay out.
MAX_LAYERS = 65_536


def int_field(config: Mapping[str, Any], name: str, default: int | None = None) -> int:
    """A positive integer field; ``default`` where absent (``None``: required)."""
    return checked_int(f"model config field {name!r}", config.get(name, default))


def layer_count(config: Mapping[str, Any]) -> int:
    """``num_hidden_layers``, required and bounded by :data:`MAX_LAYERS`."""
    return checked_int(
        "model config field 'num_hidden_layers'",
        config.get("num_hidden_layers"),
        maximum=MAX_LAYERS,
    )
