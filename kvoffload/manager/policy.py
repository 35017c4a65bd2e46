"""The eviction-policy seam of the offload index.

A policy orders the *ready* chunks of one index and picks victims. It knows
keys only: the index owns slots, pins and in-flight stores, and tells the
policy what happened. Every method is O(1) amortised per key.

Protocol, as the index drives it:

* ``insert(key)`` once a store of ``key`` completed successfully; the key is
  now resident and evictable (unless protected at eviction time).
* ``touch(key)`` when a resident key is used (a load from this tier, a hit).
* ``refresh(key)`` (optional hook) when a resident key should rank as recent
  without counting as a hit of this tier: a chunk the engine's own prefix
  cache served, or the head of a request whose tail was just stored (see
  :mod:`kvoffload.manager.usage`). Default: ``touch``.
* ``touch_many(keys)`` / ``refresh_many(keys)`` / ``insert_many(keys)``
  (optional hooks): the same for ``keys`` in order, one call per request or
  completed store; keys that are not resident are ignored by the first two,
  as by ``touch``. Default: one ``touch`` / ``refresh`` / ``insert`` per key.
* ``remove(key)`` when a resident key leaves for a reason other than
  eviction (reset of one key, a tier dropping a corrupt chunk).
* ``evict(n, protected)`` chooses up to ``n`` resident victims for which
  ``protected(key)`` is false, forgets them and returns them, oldest first.
  It asks ``protected`` of a key only to take it: a ``False`` answer means
  the key is a victim (the index's prefix-order guard counts on it).
  The index passes :func:`nothing_protected` itself when no key is (no pins,
  no keys of the store at hand): a policy may recognise it and skip asking.
  Fewer than ``n`` means no more unprotected keys exist; the index then
  undoes nothing, because it asks for victims only after checking it can
  succeed (``prepare_store`` is all or nothing).
* ``admit(key)`` (optional hook) is asked before a missing key is stored;
  returning ``False`` skips the store. Filters that track sightings record
  the sighting here.
* ``on_miss(key)`` (optional hook) is told of a lookup miss of ``key``.
* ``takes_back`` (optional property, default ``False``): whether ``insert`` of a
  key it just evicted only ranks it newest (no ghost, no adaptation). The index
  keeps prefix order itself (:mod:`kvoffload.manager._evictions`): a chunk with
  a child present is not evicted while a leaf can go. It takes such a policy's
  choice as it is and gives back the few victims that turn out parents; any
  other policy it asks about each candidate. Chains are the index's business
  otherwise: a policy never sees them.
* ``check_integrity(resident)`` (optional hook) raises ``IntegrityError``
  with the numbers if the policy's own state is inconsistent or does not
  track exactly the index's ready keys; the index's ``check_integrity`` and
  the stateful tests call it after every step.

A policy never raises on a key it does not know in ``touch``/``on_miss``;
``remove`` of an unknown key is a no-op, so the index can call it freely.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterable, Sequence

from kvoffload.errors import ConfigError, IntegrityError

__all__ = ["EvictionPolicy", "nothing_protected"]


def nothing_protected(key: bytes) -> bool:
    """The ``protected`` of an eviction where no key is protected (see ``evict``)."""
    return False


class EvictionPolicy(ABC):
    """Orders resident chunks; see the module docstring for the protocol."""

    #: Registry name of the policy, for stats and error messages.
    name: str = ""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity

    # -- required -----------------------------------------------------------
    @abstractmethod
    def insert(self, key: bytes) -> None:
        """``key`` became resident."""

    @abstractmethod
    def touch(self, key: bytes) -> None:
        """A resident ``key`` was used; unknown keys are ignored."""

    @abstractmethod
    def remove(self, key: bytes) -> None:
        """Forget a resident ``key``; unknown keys are ignored."""

    @abstractmethod
    def evict(self, n: int, protected: Callable[[bytes], bool]) -> list[bytes]:
        """Pick, forget and return up to ``n`` unprotected resident keys."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of resident keys the policy tracks (ghost entries excluded)."""

    @abstractmethod
    def reset(self) -> None:
        """Forget everything, ghosts and adaptive state included."""

    # -- optional hooks -----------------------------------------------------
    @property
    def takes_back(self) -> bool:
        """Whether ``insert`` of a key just evicted only ranks it newest (module docstring)."""
        return False

    def admit(self, key: bytes) -> bool:
        """Whether a missing ``key`` should be stored now. Default: always."""
        return True

    def admit_many(self, keys: Sequence[bytes]) -> list[bytes]:
        """The missing ``keys`` that ``admit`` lets in, asked in order.

        One call per store: a policy whose admission is on the hot path
        overrides it with a loop of its own (it must answer as ``admit``
        asked key by key would).
        """
        admit = self.admit
        return [key for key in keys if admit(key)]

    def refresh(self, key: bytes) -> None:
        """Rank a resident ``key`` as recent without counting a hit. Default: ``touch``."""
        self.touch(key)

    def touch_many(self, keys: Iterable[bytes]) -> None:
        """``touch`` each of ``keys`` in order (those not resident are ignored).

        The index ranks a whole request at a time (:mod:`kvoffload.manager.usage`):
        a policy on the hot path overrides it with a loop of its own.
        """
        touch = self.touch
        for key in keys:
            touch(key)

    def refresh_many(self, keys: Iterable[bytes]) -> None:
        """``refresh`` each of ``keys`` in order (see :meth:`touch_many`)."""
        refresh = self.refresh
        for key in keys:
            refresh(key)

    def insert_many(self, keys: Iterable[bytes]) -> None:
        """``insert`` each of ``keys`` in order (one completed store at a time)."""
        insert = self.insert
        for key in keys:
            insert(key)

    def on_miss(self, key: bytes) -> None:
        """A lookup missed ``key``. Default: nothing."""

    def check_integrity(self, resident: Collection[bytes]) -> None:
        """Raise ``IntegrityError`` if the policy does not track ``resident``.

        Default: compares sizes only; policies override it to check
        membership and their own invariants (queue bounds, ghost sizes).
        """
        if len(self) != len(resident):
            raise IntegrityError(
                f"policy {self.name!r} tracks {len(self)} keys, the index has {len(resident)} ready"
            )


def build_policy(policy: str | EvictionPolicy | None, capacity: int) -> EvictionPolicy:
    """Build a registered policy by name, or adopt a ready instance built for ``capacity``.

    The registry is imported here, not at the top: it names this module's subclasses.
    """
    if isinstance(policy, EvictionPolicy):
        if policy.capacity != capacity:
            raise ConfigError(
                f"policy {policy.name!r} was built for capacity {policy.capacity}, "
                f"but the index has num_chunks={capacity}; build it with the same capacity"
            )
        return policy
    from kvoffload.registry import DEFAULT_POLICY, POLICIES

    name = POLICIES.check(DEFAULT_POLICY if policy is None else policy)
    built = POLICIES.create(name, capacity)
    if not isinstance(built, EvictionPolicy):
        raise ConfigError(f"policy {name!r} did not build an EvictionPolicy: {built!r}")
    return built
