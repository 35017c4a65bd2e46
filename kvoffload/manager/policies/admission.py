"""An admission filter: store a chunk only the second (or N-th) time it is offered.

Most prefixes in serving traces are never shared; storing them evicts chunks
that would have been reused. ``AdmissionFilter`` wraps any policy and rejects
a missing key the first time ``prepare_store`` offers it, remembering the
sighting in a bounded FIFO of keys (``window``, default ``capacity``). A key
offered again while still remembered is admitted (if the inner policy's own
``admit`` agrees). Everything else is delegated unchanged, so the wrapper
works around LRU, ARC, S3-FIFO or any later policy.

The index asks ``admit`` only once it knows the store can proceed, so a
refused ``prepare_store`` records no sighting.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable

from kvoffload._checks import checked_int
from kvoffload.errors import ConfigError, IntegrityError
from kvoffload.manager.policy import EvictionPolicy

__all__ = ["AdmissionFilter"]


class AdmissionFilter(EvictionPolicy):
    """Admit a key on its ``sightings``-th offer within the last ``window`` keys offered.

    ``sightings=2`` (the default) is the classic second-hit filter; the
    configuration's ``store_threshold`` sets it.
    """

    def __init__(
        self, inner: EvictionPolicy, *, window: int | None = None, sightings: int = 2
    ) -> None:
        if not isinstance(inner, EvictionPolicy):
            raise ConfigError(f"AdmissionFilter wraps an EvictionPolicy, got {inner!r}")
        super().__init__(inner.capacity)
        window = inner.capacity if window is None else window
        checked_int("AdmissionFilter: window", window)
        checked_int("AdmissionFilter: sightings", sightings, minimum=2)
        self.sightings = sightings
        self.inner = inner
        self.window = window
        self.name = f"admit+{inner.name}"
        #: key -> offers seen so far (fewer than ``sightings``), oldest first.
        self._sightings: OrderedDict[bytes, int] = OrderedDict()

    @property
    def takes_back(self) -> bool:
        return self.inner.takes_back  # it ranks nothing itself

    def admit(self, key: bytes) -> bool:
        sightings = self._sightings
        seen = sightings.get(key, 0) + 1
        if seen < self.sightings:
            sightings[key] = seen
            sightings.move_to_end(key)
            if len(sightings) > self.window:
                sightings.popitem(last=False)
            return False
        if not self.inner.admit(key):
            return False
        del sightings[key]
        return True

    def insert(self, key: bytes) -> None:
        self.inner.insert(key)

    def insert_many(self, keys: Iterable[bytes]) -> None:
        self.inner.insert_many(keys)

    def touch(self, key: bytes) -> None:
        self.inner.touch(key)

    def refresh(self, key: bytes) -> None:
        self.inner.refresh(key)

    def touch_many(self, keys: Iterable[bytes]) -> None:
        self.inner.touch_many(keys)

    def refresh_many(self, keys: Iterable[bytes]) -> None:
        self.inner.refresh_many(keys)

    def remove(self, key: bytes) -> None:
        self.inner.remove(key)

    def evict(self, n: int, protected: Callable[[bytes], bool]) -> list[bytes]:
        return self.inner.evict(n, protected)

    def on_miss(self, key: bytes) -> None:
        self.inner.on_miss(key)

    def __len__(self) -> int:
        return len(self.inner)

    def reset(self) -> None:
        self._sightings.clear()
        self.inner.reset()

    def check_integrity(self, resident: Collection[bytes]) -> None:
        if len(self._sightings) > self.window:
            raise IntegrityError(
                f"{self.name}: {len(self._sightings)} sightings, window is {self.window}"
            )
        self.inner.check_integrity(resident)
