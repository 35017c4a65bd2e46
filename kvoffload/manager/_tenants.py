"""Per-tenant shares of the CPU tier: who holds which chunk, and how many each may hold.

A tenant is what ``OffloadIndex.prepare_store`` is told (the connector
passes the request's cache salt; requests without one are the ``None``
tenant). With a share ``s``, no tenant holds more than ``cap = s * capacity``
chunks (ready or being stored): a store that would take its tenant over the
cap evicts that tenant's own chunks first, in the policy's order, and only
then, if the tier is still full, anyone's. So a tenant that floods the tier
pushes out its own old chunks, never everyone else's below their cap.

Counts are kept per tenant, pins included (a pinned chunk cannot be
evicted, so it does not count as room), so that checking a store costs
O(keys of the store), not a pass over the tier.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Iterable

from kvoffload.errors import KVOffloadError

__all__ = ["TenantShares"]

Tenant = str | None

#: What ``owner.get`` returns for a key no tenant owns (``None`` is a tenant).
_NOBODY = object()


class TenantShares:
    """Who owns each chunk of one index, and each tenant's cap."""

    def __init__(self, capacity: int, share: float) -> None:
        if not 0.0 < share <= 1.0:
            raise KVOffloadError(f"tenant share must be in (0, 1], got {share!r}")
        self.share = share
        self.cap = max(1, int(share * capacity))
        self._owner: dict[bytes, Tenant] = {}
        self._held = Counter[Tenant]()  # ready + storing
        self._ready = Counter[Tenant]()
        self._pinned = Counter[Tenant]()  # distinct pinned ready keys

    def owner(self, key: bytes) -> Tenant:
        return self._owner[key]

    def over_cap(self, tenant: Tenant, count: int) -> int:
        """How many of ``tenant``'s chunks must go before it may add ``count`` more."""
        return max(0, self._held[tenant] + count - self.cap)

    def fits(
        self, tenant: Tenant, count: int, found: Collection[bytes], pins: Collection[bytes]
    ) -> bool:
        """Whether ``tenant`` can add ``count`` chunks, evicting only its own unprotected ones.

        Its chunks in ``found`` (already stored, wanted by this very store) and
        pinned ones cannot make room.
        """
        if count > self.cap:
            return False
        mine = sum(1 for k in found if k not in pins and self._owner.get(k, _NOBODY) == tenant)
        return self.over_cap(tenant, count) <= self._ready[tenant] - self._pinned[tenant] - mine

    def others(self, tenant: Tenant) -> Callable[[bytes], bool]:
        """A predicate true for chunks ``tenant`` does not own (protected from its evictions)."""
        owner = self._owner
        return lambda key: owner.get(key, _NOBODY) != tenant

    # -- state changes, mirroring the index's ----------------------------------------
    def reserve(self, keys: Iterable[bytes], tenant: Tenant) -> None:
        for key in keys:
            self._owner[key] = tenant
            self._held[tenant] += 1

    def stored(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            self._ready[self._owner[key]] += 1

    def dropped(self, keys: Iterable[bytes], *, ready: bool) -> None:
        """``keys`` left the index: evicted or reset (``ready``), or their store failed."""
        for key in keys:
            tenant = self._owner.pop(key)
            self._held[tenant] -= 1
            if ready:
                self._ready[tenant] -= 1

    def pinned(self, key: bytes, delta: int) -> None:
        """A ready ``key`` got its first pin (+1) or lost its last one (-1)."""
        self._pinned[self._owner[key]] += delta

    def held(self) -> dict[Tenant, int]:
        """Chunks held per tenant (ready or being stored), tenants holding none left out."""
        return {tenant: n for tenant, n in self._held.items() if n}

    def check(
        self, ready: Collection[bytes], storing: Collection[bytes], pins: Collection[bytes]
    ) -> None:
        """Raise ``KVOffloadError`` with the numbers if the counts disagree with the index."""
        expected_held = Counter(self._owner[k] for k in [*ready, *storing] if k in self._owner)
        expected_ready = Counter(self._owner[k] for k in ready if k in self._owner)
        expected_pinned = Counter(self._owner[k] for k in pins if k in self._owner)
        owned = len(self._owner)
        if owned != len(ready) + len(storing):
            raise KVOffloadError(
                f"tenant shares own {owned} chunks, the index holds "
                f"{len(ready)} ready + {len(storing)} storing"
            )
        for name, counts, expected in (
            ("held", self._held, expected_held),
            ("ready", self._ready, expected_ready),
            ("pinned", self._pinned, expected_pinned),
        ):
            got = {t: n for t, n in counts.items() if n}
            if got != dict(expected):
                raise KVOffloadError(f"tenant {name} counts {got} != index {dict(expected)}")
        over = {t: n for t, n in self._held.items() if n > self.cap}
        if over:
            raise KVOffloadError(f"tenants over their cap of {self.cap} chunks: {over}")
