"""One chunk file on disk and the one vectored syscall that moves it.

The format and checksums are :mod:`kvoffload.tiers._record`'s, shared with the remote tier.
"""

from __future__ import annotations

import errno
import os

from kvoffload.errors import CorruptChunkError, TierError
from kvoffload.tiers._record import (
    CHECKSUMS,
    DEFAULT_ALGORITHM,
    check_header,
    file_bytes,
    pack_header,
    seal_header,
)
from kvoffload.tiers.base import ChunkBuffer
from kvoffload.tiers.disk._direct_io import ALIGN, O_DIRECT, BufferPool, is_aligned

__all__ = ["ChunkFileIO"]


class ChunkFileIO:
    """Writes and reads whole chunk files with one vectored syscall each.

    ``direct`` selects O_DIRECT or buffered I/O. With O_DIRECT, a caller array
    that is not page aligned goes through an aligned staging buffer (one
    memcpy); aligned arrays, and every array in buffered mode, are used as is.
    """

    def __init__(self, direct: bool, algorithm: int = DEFAULT_ALGORITHM) -> None:
        if algorithm not in CHECKSUMS:
            raise TierError(f"checksum algorithm {algorithm} is not available")
        self.direct = direct
        self.algorithm = algorithm
        self._buffers = BufferPool(max_bytes=64 << 20)

    @property
    def open_flags(self) -> int:
        """Flags to open a chunk file with for :meth:`write` and :meth:`read_into`."""
        return O_DIRECT if self.direct else 0

    def _zero_copy(self, buf: ChunkBuffer) -> bool:
        return not self.direct or is_aligned(buf)

    def write(self, fd: int, name: tuple[bytes, bytes], payload: ChunkBuffer) -> None:
        """Write ``payload`` as chunk ``name`` (namespace, key) into the new, empty file
        ``fd`` (opened with :attr:`open_flags`); raise ``OSError`` on failure."""
        namespace, key = name
        n, body = payload.nbytes, payload.nbytes - payload.nbytes % ALIGN
        staged = not self._zero_copy(payload)
        with self._buffers.lease(file_bytes(n) if staged else 2 * ALIGN) as scratch:
            header = scratch[:ALIGN]
            pack_header(header, namespace, key, n, self.algorithm)
            if staged:
                scratch[ALIGN : ALIGN + n] = payload
                scratch[ALIGN + n :] = 0
                iov = [scratch]
            else:
                tail = scratch[ALIGN:]
                tail[: n - body] = payload[body:]
                tail[n - body :] = 0
                iov = [header, payload[:body]] + ([tail] if body < n else [])
            seal_header(header, len(key), CHECKSUMS[self.algorithm](payload.data))
            written = os.pwritev(fd, [buf.data for buf in iov if buf.nbytes], 0)
            if written != file_bytes(n):
                raise OSError(errno.ENOSPC, f"short write: {written} of {file_bytes(n)} B")

    def read_into(self, fd: int, name: tuple[bytes, bytes], out: ChunkBuffer) -> None:
        """Fill ``out`` from the chunk file ``fd`` (opened with :attr:`open_flags`), verified
        against chunk ``name`` (namespace, key).

        Raises ``OSError``, ``CorruptChunkError`` (bad header, truncated,
        checksum mismatch) or ``TierError`` (the chunk is intact but not
        ``out.nbytes`` long).
        """
        n, body = out.nbytes, out.nbytes - out.nbytes % ALIGN
        staged = not self._zero_copy(out)
        with self._buffers.lease(file_bytes(n) if staged else 2 * ALIGN) as scratch:
            header = scratch[:ALIGN]
            size = os.fstat(fd).st_size
            if size != file_bytes(n):
                _explain_size(fd, header, name, n, size)
            tail = scratch[ALIGN:]
            iov = [scratch] if staged else [header, out[:body]] + ([tail] if body < n else [])
            got = os.preadv(fd, [buf.data for buf in iov if buf.nbytes], 0)
            if got != file_bytes(n):
                raise CorruptChunkError(f"truncated chunk file: read {got} B")
            checked = check_header(header, name, n)
            if staged:
                out[:] = scratch[ALIGN : ALIGN + n]
            elif body < n:
                out[body:] = tail[: n - body]
        actual = CHECKSUMS[checked.algorithm](out.data)
        if actual != checked.payload_sum:
            raise CorruptChunkError(
                f"payload checksum mismatch: {actual:#x} != stored {checked.payload_sum:#x}"
            )


def _explain_size(
    fd: int, header: ChunkBuffer, name: tuple[bytes, bytes], n: int, size: int
) -> None:
    """Raise the right error for a file whose length does not fit ``n`` payload bytes."""
    if size < ALIGN or os.preadv(fd, [header.data], 0) != ALIGN:
        raise CorruptChunkError(f"truncated chunk file: {size} bytes, no complete header")
    check_header(header, name, n)
    raise CorruptChunkError(f"truncated chunk file: {size} bytes, needs {file_bytes(n)}")
