"""Lazy name -> factory registries for pluggable parts (eviction policies, tiers).

The CLI's ``choices=`` and the configuration validation read names from here,
so a new policy is one line in ``POLICIES``. Targets are ``"module:attribute"``
strings, imported only when a part is created: validating a configuration
never imports a policy or a tier.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from kvoffload.errors import ConfigError

__all__ = ["DEFAULT_POLICY", "POLICIES", "TIERS", "Registry"]


class Registry:
    """An ordered mapping of names to lazily imported factories."""

    def __init__(self, kind: str, targets: dict[str, str]) -> None:
        self.kind = kind
        self._targets = dict(targets)

    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order."""
        return tuple(self._targets)

    def __contains__(self, name: object) -> bool:
        return name in self._targets

    def register(self, name: str, target: str) -> None:
        """Add ``name`` -> ``"module:attribute"``; re-registering a name is an error."""
        if name in self._targets:
            raise ConfigError(f"{self.kind} {name!r} is already registered")
        self._targets[name] = target

    def resolve(self, name: str) -> Callable[..., Any]:
        """Import the factory for ``name``; ``ConfigError`` listing the names if unknown."""
        self.check(name)
        module_name, _, attribute = self._targets[name].partition(":")
        factory: Callable[..., Any] = getattr(importlib.import_module(module_name), attribute)
        return factory

    def create(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Build the part registered as ``name``."""
        return self.resolve(name)(*args, **kwargs)

    def check(self, name: object) -> str:
        """Return ``name`` if registered, else raise ``ConfigError`` naming the choices."""
        if not isinstance(name, str) or name not in self._targets:
            choices = ", ".join(repr(n) for n in self._targets)
            raise ConfigError(f"unknown {self.kind} {name!r}; choose one of {choices}")
        return name


#: Eviction policies of the offload index.
POLICIES = Registry(
    "eviction policy",
    {
        "lru": "kvoffload.manager.policies.lru:LRUPolicy",
        "arc": "kvoffload.manager.policies.arc:ARCPolicy",
        "s3fifo": "kvoffload.manager.policies.s3fifo:S3FIFOPolicy",
        "adaptive": "kvoffload.manager.policies.adaptive:AdaptivePolicy",
    },
)
#: The policy the index uses unless told otherwise: the best one measured (README, replay).
DEFAULT_POLICY = POLICIES.check("adaptive")

#: Lower tiers of the data plane (below the CPU slab, which is always there), in cascade order.
TIERS = Registry(
    "tier",
    {
        "disk": "kvoffload.tiers.disk:DiskTier",
        "redis": "kvoffload.tiers.remote:RedisTier",
    },
)
