"""One row of ``kvoffload bench``: a tier against its same-run reference."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["BenchRow", "best_rate"]


@dataclass(frozen=True, slots=True)
class BenchRow:
    """One tier at one chunk size; ``ref_*`` is the same-run reference (GB/s = 1e9 B/s).

    ``lookups_per_s`` and ``ref_lookups_per_s`` (keys per second) are
    measured for the lower tiers (disk, redis) and ``None`` for the CPU slab.
    """

    tier: str
    chunk_bytes: int
    store_gbps: float
    load_gbps: float
    ref_store_gbps: float
    ref_load_gbps: float
    direct_io: bool
    lookups_per_s: float | None = None
    ref_lookups_per_s: float | None = None

    @classmethod
    def of(
        cls,
        tier: str,
        chunk_bytes: int,
        rates: Sequence[float],
        *,
        direct_io: bool,
        lookups: Sequence[float] = (),
    ) -> BenchRow:
        """A row from rates in the order a bench measures them: ref store, store, ref load,
        load (GB/s); ``lookups``: ref, tier (keys per second), if measured."""
        ref_lookups, tier_lookups = lookups or (None, None)
        return cls(
            tier,
            chunk_bytes,
            store_gbps=rates[1],
            load_gbps=rates[3],
            ref_store_gbps=rates[0],
            ref_load_gbps=rates[2],
            direct_io=direct_io,
            lookups_per_s=tier_lookups,
            ref_lookups_per_s=ref_lookups,
        )

    @property
    def store_ratio(self) -> float:
        return self.store_gbps / self.ref_store_gbps

    @property
    def load_ratio(self) -> float:
        return self.load_gbps / self.ref_load_gbps

    @property
    def lookup_ratio(self) -> float | None:
        if self.lookups_per_s is None or not self.ref_lookups_per_s:
            return None
        return self.lookups_per_s / self.ref_lookups_per_s

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def best_rate(amount: int, fn: Callable[[], None], best: float, unit: float = 1e9) -> float:
    """The larger of ``best`` and ``amount / unit`` per second of one call of ``fn``."""
    start = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - start
    return max(best, amount / max(elapsed, 1e-9) / unit)
