"""What an engine does with the tiers when prefill and decode run on different engines.

vLLM names the role in ``KVTransferConfig.kv_role``. A prefill instance
(``kv_producer``) computes prompts for others: it stores and never loads, so its
lookups take neither time nor CPU-tier room from the prompts it is there to
compute. A decode instance (``kv_consumer``) continues from what producers
stored: it loads, and stores only with ``consumer_write_back`` (then a later
turn it serves finds what it generated). ``kv_both``, an engine that is not
split, does both.

Producers and consumers meet only in a tier both reach: a disk tier (engines on
one host) or a remote tier (a fleet). The CPU tier is each engine's own, so
either split role needs one of those, or it is refused at start.
"""

from __future__ import annotations

from enum import StrEnum

from kvoffload.config.values import safe_repr
from kvoffload.errors import ConfigError

__all__ = ["KVRole"]


class KVRole(StrEnum):
    """vLLM's ``kv_role``, by its value there (a string, as ``kvoffload plan --json`` prints it)."""

    BOTH = "kv_both"
    PRODUCER = "kv_producer"
    CONSUMER = "kv_consumer"

    @classmethod
    def parse(cls, raw: object) -> KVRole:
        """The role named by ``raw`` (vLLM's string; ``None``, vLLM's unset, is ``kv_both``)."""
        if raw is None:
            return cls.BOTH
        if isinstance(raw, cls):
            return raw
        for role in cls:
            if raw == role.value:
                return role
        names = ", ".join(role.value for role in cls)
        raise ConfigError(f"kv_role {safe_repr(raw)} is not a role kvoffload serves: use {names}")

    @property
    def loads(self) -> bool:
        """Whether lookups may hit: every role but a producer's."""
        return self is not KVRole.PRODUCER

    @property
    def disaggregated(self) -> bool:
        """Prefill and decode on different engines: they meet only in a shared tier."""
        return self is not KVRole.BOTH
