"""The vLLM adapter: ``"kv_connector": "KVOffloadConnector"`` from ``kvoffload.vllm``.

Only :mod:`kvoffload.vllm.connector` and the modules it alone uses (its two roles,
``_scheduler_side`` and ``_worker_side``; ``_startup``, ``_layout``, ``_messages``,
``_events``, ``_prom``, ``_ranks``) import vLLM, and only when the connector is first
asked for, so the plain logic (:mod:`~kvoffload.connector.scheduler`,
:mod:`~kvoffload.connector.worker`, ``_extras``, ``_metrics``) imports and is tested
without vLLM installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvoffload.vllm.connector import KVOffloadConnector, active_connectors

__all__ = ["KVOffloadConnector", "active_connectors"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from kvoffload.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
