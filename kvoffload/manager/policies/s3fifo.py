"""S3-FIFO (Yang et al., SOSP'23): a small probationary FIFO, a main FIFO and a ghost FIFO.

New chunks enter the small queue ``S`` (about 10% of capacity). A chunk
leaving ``S`` that was touched at least ``promote_threshold`` times moves to
the main queue ``M``; otherwise it is evicted and its key remembered in the
ghost queue ``G``. A store of a ghost key goes straight to ``M``. ``M`` is a
FIFO with a 2-bit frequency (0..3) per chunk: a chunk at its head with a
non-zero count is reinserted at the tail with the count decremented, so hits
cost one integer update and no reordering (the "lazy promotion" that makes
S3-FIFO cheap). Protected keys at a queue head are rotated to its tail.

``evict`` scans a bounded number of entries (four passes over ``M``), so a
queue made only of protected keys makes it fall back to the other queue
rather than loop.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection

from kvoffload.errors import ConfigError, IntegrityError
from kvoffload.manager._integrity import check_resident
from kvoffload.manager.policies._common import check_capacity
from kvoffload.manager.policy import EvictionPolicy

__all__ = ["S3FIFOPolicy"]

_MAX_FREQ = 3


class S3FIFOPolicy(EvictionPolicy):
    """S3-FIFO over the index's ready chunks; see the module docstring."""

    name = "s3fifo"

    def __init__(
        self, capacity: int, *, small_ratio: float = 0.1, promote_threshold: int = 1
    ) -> None:
        super().__init__(check_capacity("S3FIFOPolicy", capacity))
        if not isinstance(small_ratio, int | float) or not 0.0 < small_ratio < 1.0:
            raise ConfigError(f"S3FIFOPolicy: small_ratio must be in (0, 1), got {small_ratio!r}")
        if promote_threshold not in range(1, _MAX_FREQ + 1):
            raise ConfigError(
                f"S3FIFOPolicy: promote_threshold must be 1..{_MAX_FREQ}, got {promote_threshold!r}"
            )
        #: Target length of the small queue; the ghost queue is as long as main.
        self.small_target = max(1, round(capacity * small_ratio))
        self.ghost_capacity = max(1, capacity - self.small_target)
        self.promote_threshold = promote_threshold
        self._small: OrderedDict[bytes, None] = OrderedDict()
        self._main: OrderedDict[bytes, None] = OrderedDict()
        self._ghost: OrderedDict[bytes, None] = OrderedDict()
        self._freq: dict[bytes, int] = {}

    def insert(self, key: bytes) -> None:
        if key in self._freq:
            self.touch(key)
            return
        self._freq[key] = 0
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = None
        else:
            self._small[key] = None

    def touch(self, key: bytes) -> None:
        freq = self._freq
        count = freq.get(key)
        if count is not None and count < _MAX_FREQ:
            freq[key] = count + 1

    def remove(self, key: bytes) -> None:
        if self._freq.pop(key, None) is not None:
            self._small.pop(key, None)
            self._main.pop(key, None)

    def evict(self, n: int, protected: Callable[[bytes], bool]) -> list[bytes]:
        """Pick ``n`` victims, remembering which queue has only protected keys left.

        Without that memory a small queue full of protected keys (the prefix
        this very store found) would be rescanned for every victim.
        """
        victims: list[bytes] = []
        small_done = main_done = False
        while len(victims) < n:
            prefer_small = len(self._small) >= self.small_target or not self._main
            victim = None
            for from_small in (prefer_small, not prefer_small):
                if from_small and not small_done:
                    main_before = len(self._main)
                    victim = self._evict_small(protected)
                    small_done = victim is None
                    main_done = main_done and len(self._main) == main_before
                elif not from_small and not main_done:
                    victim = self._evict_main(protected)
                    main_done = victim is None
                if victim is not None:
                    break
            if victim is None:
                break
            victims.append(victim)
        return victims

    def _evict_small(self, protected: Callable[[bytes], bool]) -> bytes | None:
        """Pop ``S``'s head into ``M``, back to ``S`` (protected) or out to ``G``."""
        small, freq = self._small, self._freq
        for _ in range(len(small)):
            key, _none = small.popitem(last=False)
            if freq[key] >= self.promote_threshold:
                self._main[key] = None
            elif protected(key):
                small[key] = None
            else:
                del freq[key]
                ghost = self._ghost
                ghost[key] = None
                if len(ghost) > self.ghost_capacity:
                    ghost.popitem(last=False)
                return key
        return None

    def _evict_main(self, protected: Callable[[bytes], bool]) -> bytes | None:
        """Rotate ``M`` until an unprotected zero-count head appears (at most 4 passes)."""
        main, freq = self._main, self._freq
        for _ in range((_MAX_FREQ + 1) * len(main)):
            key, _none = main.popitem(last=False)
            count = freq[key]
            if count == 0 and not protected(key):
                del freq[key]
                return key
            main[key] = None
            if count:
                freq[key] = count - 1
        return None

    def __len__(self) -> int:
        return len(self._freq)

    def reset(self) -> None:
        for queue in (self._small, self._main, self._ghost):
            queue.clear()
        self._freq.clear()

    def sizes(self) -> dict[str, int]:
        """Queue lengths, for reports."""
        return {"small": len(self._small), "main": len(self._main), "ghost": len(self._ghost)}

    def check_integrity(self, resident: Collection[bytes]) -> None:
        small, main, ghost, freq = self._small, self._main, self._ghost, self._freq
        check_resident(self.name, freq, resident)
        queued = small.keys() | main.keys()
        bad_freq = sum(1 for count in freq.values() if not 0 <= count <= _MAX_FREQ)
        overlaps = len(small.keys() & main.keys()) + len(queued & ghost.keys())
        if overlaps or bad_freq or queued != freq.keys() or len(ghost) > self.ghost_capacity:
            raise IntegrityError(
                f"s3fifo: |S|={len(small)} |M|={len(main)} |G|={len(ghost)} "
                f"(ghost capacity {self.ghost_capacity}) tracked={len(freq)} "
                f"overlaps={overlaps} bad frequencies={bad_freq}"
            )
