"""The CPU tier: one host slab of fixed-size slots, pinned when CUDA is present.

Two ways in, one state:

* **Slot-addressed (the hot path).** The scheduler-side index
  (:class:`kvoffload.manager.OffloadManager`) owns the slots: its
  ``prepare_store`` / ``prepare_load`` hand out slot ids, and the engine
  gathers engine blocks straight into :meth:`CPUTier.slot` and scatters
  straight out of it, with no staging copy. After writing a slot the engine
  calls :meth:`CPUTier.bind` so the tier knows ``key -> slot``; before
  overwriting one it calls :meth:`CPUTier.reserve` (and :meth:`CPUTier.release`
  if the write failed). The index's pins are what
  keep a slot from being overwritten while it is read (invariant 2); this
  tier only records what is where.
* **Key-addressed (the Tier contract).** :meth:`put` picks a free slot
  itself (never evicting: eviction belongs to the index) and :meth:`get_into`
  copies out. These copies run under the tier's lock, so they are atomic
  with respect to each other; they are for tools, tests and lower-tier-only
  set-ups, not the engine's path.

Every slot is ``slot_bytes`` long (the largest chunk of any group), so a
chunk of any group fits any slot; the bound size of each chunk is recorded so
``get_into`` returns exactly the chunk's bytes. Host memory needs no checksum:
the bytes are the ones written, and a chunk is bound only after its write
completed.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

from kvoffload._checks import checked_int
from kvoffload.config.offload_config import ALIGN
from kvoffload.errors import ConfigError, TierError
from kvoffload.keys import short_key
from kvoffload.tiers.base import ChunkBuffer, Tier

__all__ = ["CPUTier"]


def _aligned_slab(num_slots: int, slot_bytes: int, pin: bool) -> torch.Tensor:
    """A ``[num_slots, slot_bytes]`` view whose rows start on ``ALIGN`` boundaries."""
    stride = -(-slot_bytes // ALIGN) * ALIGN
    try:
        flat = torch.empty(num_slots * stride + ALIGN, dtype=torch.uint8, pin_memory=pin)
    except RuntimeError as exc:  # out of (pinnable) host memory, or pinning without CUDA
        raise ConfigError(
            f"CPUTier: cannot allocate {num_slots} x {slot_bytes} bytes "
            f"({'pinned' if pin else 'pageable'}): {exc}; lower cpu_bytes_to_use"
        ) from exc
    skip = -flat.data_ptr() % ALIGN
    return flat[skip : skip + num_slots * stride].view(num_slots, stride)[:, :slot_bytes]


class CPUTier(Tier):
    """``num_slots`` host slots of ``slot_bytes`` each; see the module docstring.

    ``pin_memory`` defaults to "pinned if CUDA is available", which is what
    makes device copies asynchronous; pinning without CUDA is not possible.
    """

    name = "cpu"

    def __init__(self, num_slots: int, slot_bytes: int, *, pin_memory: bool | None = None) -> None:
        self.num_slots = checked_int("CPUTier: num_slots", num_slots)
        self.slot_bytes = checked_int("CPUTier: slot_bytes", slot_bytes)
        pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        #: ``[num_slots, slot_bytes]`` uint8; every slot starts on a page boundary.
        self.slab = _aligned_slab(num_slots, slot_bytes, pin)
        self.pinned = pin
        self._array = self.slab.numpy()
        self._lock = threading.Lock()
        self._key_at: list[bytes | None] = [None] * num_slots
        self._slot_of: dict[bytes, tuple[int, int]] = {}  # key -> (slot, nbytes)
        self._free: dict[int, None] = dict.fromkeys(range(num_slots))  # ordered set
        self._busy: set[int] = set()  # slots a key-addressed put is writing
        self._counters = dict.fromkeys(("binds", "puts", "gets", "put_failures", "misses"), 0)
        self._closed = False

    # -- slot-addressed hot path ---------------------------------------------------
    def slot(self, slot: int, nbytes: int | None = None) -> torch.Tensor:
        """The 1-D ``uint8`` tensor view of ``slot`` (its first ``nbytes``); no copy."""
        self._check_slot(slot)
        return self.slab[slot, : self.slot_bytes if nbytes is None else nbytes]

    def slot_array(self, slot: int, nbytes: int | None = None) -> ChunkBuffer:
        """The same memory as :meth:`slot`, as a numpy array for the Tier contract."""
        self._check_slot(slot)
        return self._array[slot, : self.slot_bytes if nbytes is None else nbytes]

    def bind(self, key: bytes, slot: int, nbytes: int) -> bytes | None:
        """Record that ``slot`` now holds ``key`` (``nbytes`` long); return the key it displaced.

        Called after the slot was written. A key bound elsewhere moves here
        and its old slot becomes free.
        """
        self._check_slot(slot)
        if not 0 < nbytes <= self.slot_bytes:
            raise TierError(f"cpu tier: chunk of {nbytes} bytes does not fit {self.slot_bytes}")
        with self._lock:
            displaced = self._unbind_slot(slot)
            old = self._slot_of.get(key)
            if old is not None:
                self._unbind_slot(old[0])
            self._key_at[slot] = key
            self._slot_of[key] = (slot, nbytes)
            self._free.pop(slot, None)
            self._busy.discard(slot)
            self._counters["binds"] += 1
            return displaced

    def reserve(self, slot: int) -> bytes | None:
        """Forget what ``slot`` holds because it is about to be overwritten; return that key.

        The slot is neither free nor bound until :meth:`bind` (write done) or
        :meth:`release` (write failed), so a key-addressed ``put`` cannot take it.
        """
        self._check_slot(slot)
        with self._lock:
            key = self._unbind_slot(slot)
            self._free.pop(slot, None)
            self._busy.add(slot)
            return key

    def release(self, slot: int) -> bytes | None:
        """Free ``slot`` and forget its key, if any (a failed write); return that key."""
        self._check_slot(slot)
        with self._lock:
            self._busy.discard(slot)
            return self._unbind_slot(slot)

    def slot_of(self, key: bytes) -> int | None:
        """The slot holding ``key``, or ``None`` when the tier does not hold it."""
        with self._lock:
            found = self._slot_of.get(key)
        return None if found is None else found[0]

    def key_at(self, slot: int) -> bytes | None:
        """The key bound to ``slot``, or ``None`` when the slot holds no chunk."""
        self._check_slot(slot)
        with self._lock:
            return self._key_at[slot]

    def holds(self, key: bytes, slot: int) -> bool:
        """Whether ``slot`` holds ``key`` now: the check a load makes before scattering."""
        return self.key_at(slot) == key

    # -- Tier contract ------------------------------------------------------------
    def put(self, key: bytes, data: ChunkBuffer) -> None:
        """Copy ``data`` into a free slot (or ``key``'s own); ``TierError`` when none is free."""
        self._check_open()
        if data.dtype != np.uint8 or data.ndim != 1 or not 0 < data.nbytes <= self.slot_bytes:
            with self._lock:
                self._counters["put_failures"] += 1
            raise TierError(
                f"cpu tier: put needs 1-D uint8 data of 1..{self.slot_bytes} bytes, "
                f"got {data.dtype} {data.shape}"
            )
        with self._lock:
            old = self._slot_of.get(key)
            slot = old[0] if old is not None else next(iter(self._free), None)
            if slot is None:
                self._counters["put_failures"] += 1
                raise TierError(
                    f"cpu tier full: {self.num_slots} slots hold chunks; key-addressed puts "
                    "never evict (the scheduler-side index owns eviction)"
                )
            self._unbind_slot(slot)
            self._free.pop(slot, None)
            self._busy.add(slot)
            np.copyto(self._array[slot, : data.nbytes], data)
            self._busy.discard(slot)
            self._key_at[slot] = key
            self._slot_of[key] = (slot, data.nbytes)
            self._counters["puts"] += 1

    def get_into(self, key: bytes, out: ChunkBuffer) -> None:
        """Copy ``key``'s chunk into ``out``; ``TierError`` if absent or sized differently."""
        self._check_open()
        with self._lock:
            found = self._slot_of.get(key)
            if found is None:
                self._counters["misses"] += 1
                raise TierError(f"cpu tier does not hold {short_key(key)}")
            slot, nbytes = found
            if out.nbytes != nbytes or out.dtype != np.uint8:
                raise TierError(
                    f"cpu tier: chunk {short_key(key)} has {nbytes} bytes, out has "
                    f"{out.nbytes} ({out.dtype})"
                )
            np.copyto(out, self._array[slot, :nbytes])
            self._counters["gets"] += 1

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._slot_of

    def discard(self, key: bytes) -> None:
        with self._lock:
            found = self._slot_of.get(key)
            if found is not None:
                self._unbind_slot(found[0])

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                **self._counters,
                "chunks": len(self._slot_of),
                "free_slots": len(self._free),
                "num_slots": self.num_slots,
                "slot_bytes": self.slot_bytes,
                "pinned": self.pinned,
            }

    def check_integrity(self) -> None:
        """Raise ``TierError`` with the numbers if the key/slot maps disagree."""
        with self._lock:
            bound = {k: s for s, k in enumerate(self._key_at) if k is not None}
            mapped = {k: s for k, (s, _) in self._slot_of.items()}
            if bound != mapped:
                raise TierError(
                    f"cpu tier: {len(bound)} slots bound but {len(mapped)} keys mapped, "
                    f"{len(set(bound.items()) ^ set(mapped.items()))} entries disagree"
                )
            free = set(self._free)
            expected = set(range(self.num_slots)) - set(bound.values()) - self._busy
            if free != expected:
                raise TierError(
                    f"cpu tier: {len(free)} free slots listed, {len(expected)} expected "
                    f"({len(free ^ expected)} differ)"
                )

    def close(self) -> None:
        """Forget every chunk; the slab is freed with the last reference to it."""
        with self._lock:
            self._closed = True
            self._slot_of.clear()
            self._key_at = [None] * self.num_slots
            self._free = dict.fromkeys(range(self.num_slots))

    # -- helpers ----------------------------------------------------------------
    def _unbind_slot(self, slot: int) -> bytes | None:
        """Free ``slot`` and forget its key; caller holds the lock."""
        key = self._key_at[slot]
        if key is not None:
            self._key_at[slot] = None
            del self._slot_of[key]
        self._free[slot] = None
        return key

    def _check_slot(self, slot: int) -> None:
        checked_int("cpu tier: slot", slot, minimum=0, maximum=self.num_slots - 1, error=TierError)

    def _check_open(self) -> None:
        if self._closed:
            raise TierError("cpu tier is closed")
