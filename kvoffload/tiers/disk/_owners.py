"""Owners of temp files in a shared namespace directory: who may remove a writer's leftovers.

Each tier holds an exclusive ``flock`` on ``<owner>.owner`` for its life and names its temp
files ``<key>.<owner>.<n>.tmp``. Another process removes them only after taking that lock
itself, which succeeds only once the owner has exited (the kernel drops ``flock`` locks of a
dead process, whatever its pid namespace): temp files of a live writer are never deleted,
those of a crashed one always can be. The owner file is locked under another name and then
renamed into place, so no process ever sees an unlocked owner file of a live one. ``flock``
(not ``fcntl`` locks) because closing another descriptor of the same file in the same
process does not drop it.

Built on :mod:`~kvoffload.tiers.disk._files` (its calls relative to the directory's
descriptor): a writer holds an owner's lock (:mod:`~kvoffload.tiers.disk._writer`), a
repair takes a dead one's (:mod:`~kvoffload.tiers.disk._repair`).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import stat
from collections.abc import Iterator

from kvoffload.tiers.disk._files import SAFE_OPEN, NamespaceDir, remove_regular

__all__ = ["FRESH_OWNER", "OwnerLock", "dead_owner", "owner_of_temp", "owner_tokens"]

#: Temp files: ``<key hex or "probe">.<owner>.<n>.tmp``.
_TEMP = re.compile(r"[0-9a-z]+\.([0-9a-f]{16})\.[0-9]+\.tmp")
_OWNER = re.compile(r"([0-9a-f]{16})\.owner")
#: Suffix of an owner file before it is locked and renamed into place.
FRESH_OWNER = ".owner-new"


def owner_of_temp(name: str) -> str | None:
    """The owner token in a temp file's name, or ``None`` if it carries none we know."""
    match = _TEMP.fullmatch(name)
    return match[1] if match else None


class OwnerLock:
    """This process's claim on its temp files: ``<token>.owner``, ``flock``'ed while alive."""

    def __init__(self, directory: NamespaceDir) -> None:
        self.token = secrets.token_hex(8)
        self._dir = directory
        # Locked under a name no other process checks, then renamed into place: an owner
        # file is never visible unlocked (another process would take it for a dead one's).
        fresh = f"{self.token}{FRESH_OWNER}"
        self._fd: int | None = directory.create(fresh)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            directory.rename(fresh, f"{self.token}.owner")
        except BaseException:
            directory.remove(fresh)
            os.close(self._fd)
            raise

    def temp_name(self, stem: str, n: int) -> str:
        return f"{stem}.{self.token}.{n}.tmp"

    def release(self) -> None:
        """Give up the claim: the file goes, then the lock (nothing of ours is in flight)."""
        if self._fd is not None:
            self._dir.remove(f"{self.token}.owner")
            os.close(self._fd)
            self._fd = None


def owner_tokens(names: list[str]) -> set[str]:
    """Tokens of the owner files among ``names``."""
    return {m[1] for name in names if (m := _OWNER.fullmatch(name))}


@contextlib.contextmanager
def dead_owner(dir_fd: int, token: str) -> Iterator[bool]:
    """``True``, holding its lock, while the owner ``token`` is known to have exited.

    An owner file that does not exist means the owner is gone (it is created
    before its first temp file and removed after its last). One that is not a
    regular file, or cannot be opened, cannot be verified: ``False``.
    """
    name = f"{token}.owner"
    try:
        fd = os.open(name, os.O_RDONLY | SAFE_OPEN, dir_fd=dir_fd)
    except FileNotFoundError:
        yield True
        return
    except OSError:
        yield False
        return
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            yield False
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
        remove_regular(dir_fd, name)
    finally:
        os.close(fd)
