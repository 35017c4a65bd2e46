"""Hand-off markers: a producer's word, in the shared tier, that chunks are on their way.

Prefill and decode on different engines meet in a tier both reach
(:mod:`kvoffload.config.roles`). A producer's stores reach that tier after its
step's output has left: the store job copies the KV out of the engine before
the output goes, and writes the disk or the server afterwards. A proxy sends
the request on to a consumer at once, whose lookup would then find nothing and
recompute the whole prompt, with the KV milliseconds away.

So a producer announces every chunk it is about to store, in the shared tier,
when it plans the store: before the forward pass that computes the chunk, so
before any output of that step can leave. A consumer whose hit stops short of
its prompt asks whether a chunk past the hit is announced and, if one is,
answers vLLM "ask again" rather than a miss, for at most ``handoff_wait_ms``
(:mod:`kvoffload.connector.handoffs`). A marker is a hint that expires after
the announcing producer's ``handoff_wait_ms``: a producer that dies mid-store
leaves markers that lapse, and never a partial chunk (a disk store renames a
whole file into place, a remote store sets a whole record). A consumer that
waited in vain loads what is there and computes the rest.

Where markers live:

* **Disk**: one empty file per chunk in ``<disk_path>/handoff/``, named by the
  namespace's fingerprint and the key, its modification time the announcement.
  The producer removes it once the store job reports (the chunk file is then in
  place, or the store failed), and removes its namespace's lapsed ones at
  start (those of a producer that was killed).
* **Redis / Valkey**: ``kvoffload:<namespace>:handoff:<key>``, set with an expiry
  (:meth:`~kvoffload.tiers.remote.RedisTier.announce`). It expires by itself:
  the write-behind queue sets the chunk after the job has reported, so the
  producer cannot tell when the chunk landed.

A marker that cannot be written (a full disk, the server down) only means a
consumer does not wait: it is counted, never raised into the engine.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from kvoffload.errors import TierError
from kvoffload.tiers._validation import namespace_fingerprint, valid_key

if TYPE_CHECKING:
    from kvoffload.config import OffloadConfig

__all__ = ["HANDOFF_DIR", "Announcing", "DiskMarkers", "HandoffBoard", "Markers", "handoff_board"]

logger = logging.getLogger("kvoffload")

#: The directory under ``disk_path`` that holds the disk tier's markers.
HANDOFF_DIR = "handoff"

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_MARK_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class Markers(Protocol):
    """Announcements of chunks on their way to one shared tier, for one namespace."""

    def announce(self, keys: Sequence[bytes]) -> int:
        """Mark ``keys`` as being stored; returns how many marks failed (counted by the caller)."""
        ...

    def withdraw(self, keys: Sequence[bytes]) -> None:
        """The stores of ``keys`` ended (landed or failed): their marks may go."""
        ...

    def announced(self, keys: Sequence[bytes]) -> bool:
        """Whether some key of ``keys`` carries a live mark."""
        ...

    def close(self) -> None: ...


class DiskMarkers:
    """Marks as empty files in ``<path>/handoff/``; see the module docstring.

    ``lifetime_s``: how long a mark counts. Only a producer (``writer``) creates the
    directory and sweeps its namespace's lapsed marks at start; a consumer opens
    the directory once it exists and never writes in it.
    """

    def __init__(
        self, path: str | os.PathLike[str], namespace: bytes, lifetime_s: float, *, writer: bool
    ) -> None:
        self._root = Path(path)
        self._prefix = namespace_fingerprint(namespace).hex() + "."
        self.lifetime_s = lifetime_s
        self._fd: int | None = None
        self._writer = writer
        if writer:
            self.sweep()

    def _directory(self) -> int | None:
        """The marks' directory, opened once it exists (a producer creates it, and
        ``disk_path`` with it if the disk tier has not yet: the sides start in any order)."""
        if self._fd is None:
            with contextlib.suppress(OSError):  # the disk tier reports an unusable path
                if self._writer:
                    os.makedirs(self._root / HANDOFF_DIR, mode=0o700, exist_ok=True)
                self._fd = os.open(self._root / HANDOFF_DIR, _DIR_FLAGS)
        return self._fd

    def _name(self, key: bytes) -> str:
        return self._prefix + key.hex()

    def announce(self, keys: Sequence[bytes]) -> int:
        fd = self._directory()
        if fd is None:
            return len(keys)
        failed = 0
        for key in keys:
            try:
                mark = os.open(self._name(key), _MARK_FLAGS, 0o600, dir_fd=fd)
                try:  # a mark left by an earlier store of the key counts from now
                    os.utime(mark)
                finally:
                    os.close(mark)
            except OSError:
                failed += 1
        return failed

    def withdraw(self, keys: Sequence[bytes]) -> None:
        fd = self._directory()
        if fd is None:
            return
        for key in keys:
            with contextlib.suppress(OSError):
                os.unlink(self._name(key), dir_fd=fd)

    def announced(self, keys: Sequence[bytes]) -> bool:
        fd = self._directory()
        if fd is None:
            return False
        since = time.time() - self.lifetime_s
        for key in keys:
            if not valid_key(key):
                continue
            try:
                st = os.lstat(self._name(key), dir_fd=fd)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode) and st.st_mtime >= since:
                return True
        return False

    def sweep(self) -> int:
        """Remove this namespace's lapsed marks (a producer killed mid-store); how many went."""
        fd = self._directory()
        if fd is None:
            return 0
        since, removed = time.time() - self.lifetime_s, 0
        for name in os.listdir(fd):
            if not name.startswith(self._prefix):
                continue
            with contextlib.suppress(OSError):
                st = os.lstat(name, dir_fd=fd)
                if stat.S_ISREG(st.st_mode) and st.st_mtime < since:
                    os.unlink(name, dir_fd=fd)
                    removed += 1
        return removed

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


@runtime_checkable
class Announcing(Protocol):
    """A remote tier that keeps marks beside its chunks
    (:class:`~kvoffload.tiers.remote.RedisTier`)."""

    def announce(self, keys: Sequence[bytes], lifetime_ms: int) -> None: ...

    def announced(self, keys: Sequence[bytes]) -> bool: ...

    def close(self) -> None: ...


class _RemoteMarkers:
    """Marks on the remote tier of the namespace, through a connection of their own (as a
    scheduler's probe has)."""

    def __init__(self, tier: Announcing, lifetime_ms: int) -> None:
        self._tier = tier
        self._lifetime_ms = lifetime_ms

    def announce(self, keys: Sequence[bytes]) -> int:
        try:
            self._tier.announce(keys, self._lifetime_ms)
        except TierError:
            return len(keys)
        return 0

    def withdraw(self, keys: Sequence[bytes]) -> None:
        return None  # they expire: the chunk lands later than the job reports

    def announced(self, keys: Sequence[bytes]) -> bool:
        try:
            return self._tier.announced(keys)
        except TierError:
            return False

    def close(self) -> None:
        self._tier.close()


class HandoffBoard:
    """The marks of one engine: on each shared tier, for each namespace its ranks store under.

    A producer's board announces and withdraws; a consumer's asks. Tensor-parallel
    ranks that hold shards store under a namespace each, so a chunk counts as
    announced when any rank's shard is.
    """

    def __init__(self, markers: Sequence[Markers]) -> None:
        self._markers = tuple(markers)

    def announce(self, keys: Sequence[bytes]) -> int:
        """Mark ``keys`` on every tier; returns the marks that failed."""
        if not keys:
            return 0
        return sum(m.announce(keys) for m in self._markers)

    def withdraw(self, keys: Sequence[bytes]) -> None:
        for markers in self._markers:
            markers.withdraw(keys)

    def announced(self, keys: Sequence[bytes]) -> bool:
        return bool(keys) and any(m.announced(keys) for m in self._markers)

    def close(self) -> None:
        for markers in self._markers:
            markers.close()


def handoff_board(config: OffloadConfig, namespaces: Sequence[bytes]) -> HandoffBoard | None:
    """The board of a producer or a consumer (``None`` for ``kv_both``, or with
    ``handoff_wait_ms`` 0): marks on its disk tier and its remote tier."""
    from kvoffload.tiers.from_config import remote_tier

    if not (config.announces_stores or config.awaits_handoffs):
        return None
    writer = config.announces_stores
    markers: list[Markers] = []
    for namespace in dict.fromkeys(namespaces):
        if config.disk_path is not None:
            lifetime = config.handoff_wait_ms / 1000
            markers.append(DiskMarkers(config.disk_path, namespace, lifetime, writer=writer))
        if config.remote_url is not None:
            tier = remote_tier(config, namespace)
            if isinstance(tier, Announcing):
                markers.append(_RemoteMarkers(tier, config.handoff_wait_ms))
            else:  # a remote tier registered in its place, without marks: nobody waits
                tier.close()
    return HandoffBoard(markers)
