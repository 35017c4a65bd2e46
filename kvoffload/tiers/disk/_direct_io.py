"""O_DIRECT plumbing for the disk tier: alignment, reusable aligned buffers, the probe.

O_DIRECT moves bytes between the device and user memory without the page
cache, so a tier that holds far more than RAM neither evicts the host's page
cache nor pays a second copy. Linux then demands that the buffer address, the
length and the file offset are multiples of the device's logical block size;
:data:`ALIGN` (one constant, in :mod:`kvoffload.config.offload_config`) satisfies them.

Aligned memory comes from anonymous ``mmap`` (always page aligned). Mapping and
faulting in 16 MiB costs about as much as writing it, so buffers are kept in a
small :class:`BufferPool` and reused across chunks of the same size.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections.abc import Iterator

import numpy as np

from kvoffload.config.offload_config import ALIGN
from kvoffload.tiers.base import ChunkBuffer

__all__ = ["ALIGN", "BufferPool", "address_of", "is_aligned", "probe_direct_io", "round_up"]

#: ``os.O_DIRECT`` where the platform has it (Linux); 0 elsewhere, so direct I/O is never tried.
O_DIRECT: int = getattr(os, "O_DIRECT", 0)


def round_up(n: int, align: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``align``."""
    return -(-n // align) * align


def address_of(buf: ChunkBuffer) -> int:
    """The address of ``buf``'s first byte (numpy's data pointer)."""
    return int(buf.__array_interface__["data"][0])


def is_aligned(buf: ChunkBuffer) -> bool:
    """Whether ``buf`` may be handed to O_DIRECT as is (address on an ALIGN boundary)."""
    return address_of(buf) % ALIGN == 0


def aligned_empty(nbytes: int) -> ChunkBuffer:
    """A new page-aligned uint8 array of ``nbytes`` (at least one page), zero-filled by the OS."""
    mapping = mmap.mmap(-1, max(nbytes, ALIGN))
    return np.frombuffer(mapping, dtype=np.uint8, count=nbytes)


def probe_direct_io(dir_fd: int, name: str) -> bool:
    """Whether files in the directory ``dir_fd`` accept O_DIRECT reads and writes.

    Probed once per tier by really writing and reading one aligned block in a
    new file ``name`` (removed again), because some file systems (tmpfs)
    refuse the open flag while others (some FUSE and network mounts) accept it
    and fail the first write. The file is created exclusively, without
    following a link, so the probe never touches what another process owns.
    """
    if not O_DIRECT:
        return False
    block = aligned_empty(ALIGN)
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | O_DIRECT | os.O_CLOEXEC
    try:
        fd = os.open(name, flags, 0o600, dir_fd=dir_fd)
    except OSError:
        return False
    try:
        return os.pwrite(fd, block.data, 0) == ALIGN and os.preadv(fd, [block.data], 0) == ALIGN
    except OSError:
        return False
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=dir_fd)


class BufferPool:
    """Aligned staging buffers, reused by size, bounded in total bytes.

    ``lease(n)`` hands out a buffer of exactly ``n`` bytes for the duration of
    a ``with`` block. Buffers return to the pool unless keeping them would push
    the pool over ``max_bytes``; then they are dropped (unmapped by GC).
    """

    def __init__(self, max_bytes: int) -> None:
        self._max_bytes = max_bytes
        self._free: dict[int, list[ChunkBuffer]] = {}
        self._held_bytes = 0
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def lease(self, nbytes: int) -> Iterator[ChunkBuffer]:
        """An aligned buffer of ``nbytes``; its contents are whatever the last user left."""
        buf = self._take(nbytes)
        try:
            yield buf
        finally:
            self._give(buf)

    def _take(self, nbytes: int) -> ChunkBuffer:
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                self._held_bytes -= nbytes
                return free.pop()
        return aligned_empty(nbytes)

    def _give(self, buf: ChunkBuffer) -> None:
        with self._lock:
            if self._held_bytes + buf.nbytes <= self._max_bytes:
                self._free.setdefault(buf.nbytes, []).append(buf)
                self._held_bytes += buf.nbytes
