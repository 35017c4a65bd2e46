"""The CPU slab: one host buffer of fixed-size slots, pinned when CUDA is present.

It is addressed by slot, not by key, and it is not a :class:`~kvoffload.tiers.base.Tier`:
the scheduler-side index (:class:`kvoffload.manager.OffloadIndex`) owns the
slots and decides what lives where. Its ``prepare_store`` / ``prepare_load``
hand out slot ids, and the engine gathers engine blocks straight into
:meth:`CPUSlab.slot` and scatters straight out of it, with no staging copy.
The slab only records what is where, so a load can check its chunk is still
in its slot:

* :meth:`reserve` before a slot is overwritten (it forgets the slot's key);
* :meth:`bind` once the write completed (``key -> slot``);
* :meth:`release` if the write failed (the slot holds nothing).

The index's pins are what keep a slot from being overwritten while it is read
(invariant 2). Every slot is ``slot_bytes`` long (the largest chunk of any
group), so a chunk of any group fits any slot. Host memory needs no checksum:
the bytes are the ones written, and a chunk is bound only after its write
completed.

Its :class:`~kvoffload.tiers.stats.TierStats` (``stats()``) count the engine's
copies in (stores) and out (loads), and the loads whose chunk was not in its
slot (misses: promoted from a lower tier, or found nowhere). The engine and
the cascade record each where it happens, in :attr:`CPUSlab.counters`;
evictions are the index's, counted there.
"""

from __future__ import annotations

import threading

import torch

from kvoffload._checks import checked_int
from kvoffload.config.offload_config import ALIGN
from kvoffload.errors import ConfigError, IntegrityError, TierError
from kvoffload.tiers.base import ChunkBuffer
from kvoffload.tiers.stats import TierCounters, TierStats

__all__ = ["CPUSlab", "slab_bytes"]


def slab_bytes(num_slots: int, slot_bytes: int) -> int:
    """Bytes a slab of ``num_slots`` slots takes in a buffer that starts on an ``ALIGN``
    boundary (a shared-memory mapping does): each slot is rounded up to ``ALIGN``."""
    return num_slots * -(-slot_bytes // ALIGN) * ALIGN


def _slab_in(buffer: torch.Tensor, num_slots: int, slot_bytes: int) -> torch.Tensor:
    """The slab's view of a caller's flat ``uint8`` buffer (a shared-memory region)."""
    stride = -(-slot_bytes // ALIGN) * ALIGN
    need = num_slots * stride
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < need:
        raise ConfigError(
            f"CPUSlab: a buffer of {num_slots} slots of {slot_bytes} bytes must be a 1-D "
            f"uint8 tensor of at least {need} bytes, got {buffer.dtype} {tuple(buffer.shape)}"
        )
    if buffer.data_ptr() % ALIGN:
        raise ConfigError(f"CPUSlab: a buffer must start on a {ALIGN}-byte boundary")
    return buffer[:need].view(num_slots, stride)[:, :slot_bytes]


def _aligned_slab(num_slots: int, slot_bytes: int, pin: bool) -> torch.Tensor:
    """A ``[num_slots, slot_bytes]`` view whose rows start on ``ALIGN`` boundaries."""
    stride = -(-slot_bytes // ALIGN) * ALIGN
    try:
        flat = torch.empty(num_slots * stride + ALIGN, dtype=torch.uint8, pin_memory=pin)
    except RuntimeError as exc:  # out of (pinnable) host memory, or pinning without CUDA
        raise ConfigError(
            f"CPUSlab: cannot allocate {num_slots} x {slot_bytes} bytes "
            f"({'pinned' if pin else 'pageable'}): {exc}; lower cpu_bytes_to_use"
        ) from exc
    skip = -flat.data_ptr() % ALIGN
    return flat[skip : skip + num_slots * stride].view(num_slots, stride)[:, :slot_bytes]


class CPUSlab:
    """``num_slots`` host slots of ``slot_bytes`` each; see the module docstring.

    ``pin_memory`` defaults to "pinned if CUDA is available", which is what
    makes device copies asynchronous; pinning without CUDA is not possible.
    With ``buffer`` (a flat ``uint8`` tensor of at least :func:`slab_bytes`,
    starting on a page: a shared-memory region the ranks of an engine map,
    see :mod:`kvoffload.tiers.shared`) the slots live there and nothing is
    allocated; ``pin_memory`` then only says whether the caller pinned it.
    """

    name = "cpu"

    def __init__(
        self,
        num_slots: int,
        slot_bytes: int,
        *,
        pin_memory: bool | None = None,
        buffer: torch.Tensor | None = None,
    ) -> None:
        self.num_slots = checked_int("CPUSlab: num_slots", num_slots)
        self.slot_bytes = checked_int("CPUSlab: slot_bytes", slot_bytes)
        pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        #: ``[num_slots, slot_bytes]`` uint8; every slot starts on a page boundary.
        self.slab = (
            _aligned_slab(num_slots, slot_bytes, pin)
            if buffer is None
            else _slab_in(buffer, num_slots, slot_bytes)
        )
        self.pinned = pin
        #: Ranks whose slabs are these very slots (a replicated layout's shared region):
        #: each chunk here is the one copy they all read. 1: this rank's own slots.
        self.ranks = 1
        #: Where the engine counts its copies into the slab (stores) and out of it (loads).
        self.counters = TierCounters(self.name)
        self._array = self.slab.numpy()
        self._lock = threading.Lock()
        self._key_at: list[bytes | None] = [None] * num_slots
        self._slot_of: dict[bytes, tuple[int, int]] = {}  # key -> (slot, nbytes)
        self._busy: set[int] = set()  # reserved slots: being written, neither free nor bound
        self._used = 0

    def slot(self, slot: int, nbytes: int | None = None) -> torch.Tensor:
        """The 1-D ``uint8`` tensor view of ``slot`` (its first ``nbytes``); no copy."""
        self._check_slot(slot)
        return self.slab[slot, : self.slot_bytes if nbytes is None else nbytes]

    def slot_array(self, slot: int, nbytes: int | None = None) -> ChunkBuffer:
        """The same memory as :meth:`slot`, as a numpy array for the lower tiers."""
        self._check_slot(slot)
        return self._array[slot, : self.slot_bytes if nbytes is None else nbytes]

    def reserve(self, slot: int) -> bytes | None:
        """Forget what ``slot`` holds because it is about to be overwritten; return that key.

        The slot holds nothing until :meth:`bind` (write done) or
        :meth:`release` (write failed).
        """
        self._check_slot(slot)
        with self._lock:
            key = self._unbind_slot(slot)
            self._busy.add(slot)
            return key

    def bind(self, key: bytes, slot: int, nbytes: int) -> bytes | None:
        """Record that ``slot`` now holds ``key`` (``nbytes`` long); return the key it displaced.

        Called after the slot was written. A key bound elsewhere moves here
        and its old slot holds nothing.
        """
        self._check_slot(slot)
        if not 0 < nbytes <= self.slot_bytes:
            raise TierError(f"cpu slab: chunk of {nbytes} bytes does not fit {self.slot_bytes}")
        with self._lock:
            displaced = self._unbind_slot(slot)
            old = self._slot_of.get(key)
            if old is not None:
                self._unbind_slot(old[0])
            self._key_at[slot] = key
            self._slot_of[key] = (slot, nbytes)
            self._used += nbytes
            self._busy.discard(slot)
            return displaced

    def release(self, slot: int) -> bytes | None:
        """Make ``slot`` hold nothing (a failed write, or a chunk dropped); return its key."""
        self._check_slot(slot)
        with self._lock:
            self._busy.discard(slot)
            return self._unbind_slot(slot)

    def holds(self, key: bytes, slot: int) -> bool:
        """Whether ``slot`` holds ``key`` now: the check a load makes before scattering."""
        self._check_slot(slot)
        with self._lock:
            return self._key_at[slot] == key

    def stats(self) -> TierStats:
        """The engine's copies in and out, and how much of the slab holds chunks."""
        with self._lock:
            chunks, used, busy = len(self._slot_of), self._used, len(self._busy)
        return self.counters.snapshot(
            used_bytes=used,
            chunks=chunks,
            capacity_bytes=self.num_slots * self.slot_bytes,
            gauges={"free_slots": self.num_slots - chunks - busy, "pinned": int(self.pinned)},
        )

    def check_integrity(self) -> None:
        """Raise ``IntegrityError`` with the numbers if the key/slot maps disagree."""
        with self._lock:
            bound = {k: s for s, k in enumerate(self._key_at) if k is not None}
            mapped = {k: s for k, (s, _) in self._slot_of.items()}
            if bound != mapped:
                raise IntegrityError(
                    f"cpu slab: {len(bound)} slots bound but {len(mapped)} keys mapped, "
                    f"{len(set(bound.items()) ^ set(mapped.items()))} entries disagree"
                )
            used = sum(n for _, n in self._slot_of.values())
            both = self._busy & set(bound.values())
            if used != self._used or both:
                raise IntegrityError(
                    f"cpu slab: bound chunks sum to {used} B, {self._used} B recorded; "
                    f"{len(both)} slots both reserved and bound"
                )

    def close(self) -> None:
        """Forget every chunk; the slab is freed with the last reference to it."""
        with self._lock:
            self._slot_of.clear()
            self._key_at = [None] * self.num_slots
            self._busy.clear()
            self._used = 0

    def _unbind_slot(self, slot: int) -> bytes | None:
        """Forget ``slot``'s key; caller holds the lock."""
        key = self._key_at[slot]
        if key is not None:
            self._key_at[slot] = None
            self._used -= self._slot_of.pop(key)[1]
        return key

    def _check_slot(self, slot: int) -> None:
        checked_int("cpu slab: slot", slot, minimum=0, maximum=self.num_slots - 1, error=TierError)
