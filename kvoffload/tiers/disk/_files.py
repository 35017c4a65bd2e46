"""The disk tier's file system calls: relative to directory descriptors, regular files only.

A ``disk_path`` may be shared with other processes and hold things kvoffload
did not put there: links to files elsewhere, FIFOs, device nodes, directories
with a chunk's name, sparse files. Every call here is built so that none of
them reaches outside ``disk_path``, blocks, or is mistaken for a chunk:

* **Descriptors, not paths.** ``disk_path`` is opened once (it may be a link
  the operator chose); the namespace directory below it is created 0700 and
  opened with ``O_NOFOLLOW``, and refused at start if it is a link (a linked
  namespace would make eviction delete files in the link's target). Every
  file is then opened, created, renamed and unlinked *relative to that
  descriptor* with ``O_NOFOLLOW``, so no link in the directory is followed.
  Nothing is ever ``utime``'d: recency lives in the shared index.
* **Regular files only.** A name is ``lstat``'ed before it is opened (opening
  a device runs its driver; opening a FIFO for reading waits for a writer), is
  opened with ``O_NONBLOCK`` (a FIFO swapped in after the ``lstat`` still
  cannot block), and the opened descriptor is ``fstat``'ed again. Anything
  else is :class:`NotRegular`: the tier skips it, counts it, and never
  deletes it (it cannot verify what it is).
* **Blocks, not lengths.** A file found on disk is charged what it occupies
  (``st_blocks * 512``), so a 1 TiB sparse file costs its few blocks, not the
  budget.

Which process may remove whose temp files is :mod:`~kvoffload.tiers.disk._owners`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
from collections.abc import Callable, Iterator
from enum import Enum
from functools import partial
from pathlib import Path
from typing import NamedTuple

from kvoffload.errors import ConfigError, TierError
from kvoffload.tiers._record import MAX_KEY_BYTES

__all__ = [
    "NOT_REGULAR",
    "READ_ONLY",
    "SAFE_OPEN",
    "Found",
    "ReadOnly",
    "NamespaceDir",
    "NotRegular",
    "Removal",
    "charged_bytes",
    "chunk_name",
    "is_regular",
    "os_errors",
    "parse_chunk_name",
    "remove_regular",
]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
#: Every file open: never follow a link, never block, never leak into a child.
SAFE_OPEN = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_CHUNK = re.compile(rf"((?:[0-9a-f]{{2}}){{1,{MAX_KEY_BYTES}}})\.kv")
#: ``errno`` of an open that met a link (``O_NOFOLLOW``) or a directory.
NOT_REGULAR = (errno.ELOOP, errno.EISDIR, errno.ENXIO)
#: ``errno`` of a write refused for good: a read-only mount, an immutable directory
#: (``chattr +i``), no write permission.
READ_ONLY = (errno.EROFS, errno.EPERM, errno.EACCES)


@contextlib.contextmanager
def os_errors(what: str, error: type[TierError | ConfigError] = TierError) -> Iterator[None]:
    """The disk tier's one translation of ``OSError``: ``TierError`` for a call (that call
    fails, the tier serves on), ``ConfigError`` at start-up (the directory is unusable)."""
    try:
        yield
    except OSError as exc:
        raise error(f"{what} failed: {exc}") from exc


class NotRegular(Exception):
    """A name in the directory is a link, FIFO, device or directory: skipped, never deleted."""


class Removal(Enum):
    """What :meth:`NamespaceDir.remove` did."""

    REMOVED = "removed"
    GONE = "gone"
    NOT_REGULAR = "not_regular"
    REPLACED = "replaced"


class Found(NamedTuple):
    """A regular file the scan found: its name, length, charged bytes and mtime."""

    name: str
    size: int
    charged: int
    mtime_ns: int


def charged_bytes(st: os.stat_result) -> int:
    """What a file costs the budget: the blocks it occupies, not its apparent length."""
    return st.st_blocks * 512


def chunk_name(key: bytes) -> str:
    """The file name of chunk ``key``: hex only, never a user string."""
    return f"{key.hex()}.kv"


def parse_chunk_name(name: str) -> bytes | None:
    """The key a chunk file's name holds, or ``None`` if it is no chunk's name."""
    match = _CHUNK.fullmatch(name)
    return bytes.fromhex(match[1]) if match else None


class ReadOnly(OSError):
    """A directory the tier must create lies where writes are refused for good
    (:data:`READ_ONLY`): a read-only ``disk_path`` that holds nothing to serve."""


def _mkdir(make: Callable[[], None]) -> None:
    try:
        make()
    except OSError as exc:
        if exc.errno in READ_ONLY:
            raise ReadOnly(exc.errno, exc.strerror, exc.filename) from exc
        raise


def _open_root(root: Path) -> int:
    missing = [p for p in (root, *root.parents) if not os.path.lexists(p)]
    try:
        for directory in reversed(missing):  # missing parents 0700 too (mkdir -p uses the umask)
            _mkdir(partial(directory.mkdir, mode=0o700, exist_ok=True))
        return os.open(root, _DIR_FLAGS)
    except ReadOnly:
        raise
    except NotADirectoryError as exc:
        raise ConfigError(
            f"disk_path {str(root)!r} is not a directory; point it at a directory"
        ) from exc
    except OSError as exc:
        raise ConfigError(f"disk_path {str(root)!r} cannot be opened: {exc.strerror}") from exc


def _open_below(root_fd: int, name: str, where: Path, *, create: bool) -> int:
    """Open directory ``name`` under ``root_fd`` without following a link (create it 0700)."""
    if create:
        with contextlib.suppress(FileExistsError):
            _mkdir(partial(os.mkdir, name, 0o700, dir_fd=root_fd))
    st = os.stat(name, dir_fd=root_fd, follow_symlinks=False)
    if stat.S_ISLNK(st.st_mode):
        target = os.readlink(name, dir_fd=root_fd)
        raise ConfigError(
            f"disk tier directory {str(where / name)!r} is a symbolic link (to {target!r}); "
            "kvoffload keeps its files inside disk_path and does not follow it: remove the link"
        )
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(
            f"disk tier directory {str(where / name)!r} is not a directory; remove it"
        )
    return os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=root_fd)


class NamespaceDir:
    """One namespace directory under ``root``, held open; every call is relative to it.

    :class:`ReadOnly` if it (or ``root``) is missing and cannot be created for good.
    """

    def __init__(self, root: Path, name: str) -> None:
        self.path = root / name
        self.root_fd = _open_root(root)
        try:
            self.fd = _open_below(self.root_fd, name, root, create=True)
        except ReadOnly:
            os.close(self.root_fd)
            raise
        except OSError as exc:
            os.close(self.root_fd)
            raise ConfigError(f"disk tier directory {str(self.path)!r}: {exc.strerror}") from exc
        except BaseException:
            os.close(self.root_fd)
            raise

    def close(self) -> None:
        for fd in (self.fd, self.root_fd):
            with contextlib.suppress(OSError):
                os.close(fd)

    def lstat(self, name: str) -> os.stat_result | None:
        """The entry's own status (a link's, not its target's); ``None`` if there is none."""
        try:
            return os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def is_regular(self, name: str) -> bool:
        return is_regular(self.fd, name)

    def open_regular(self, name: str, flags: int) -> int | None:
        """A descriptor of regular file ``name``; ``None`` if absent; :class:`NotRegular` else."""
        st = self.lstat(name)
        if st is None:
            return None
        if not stat.S_ISREG(st.st_mode):
            raise NotRegular(name)
        try:
            fd = os.open(name, os.O_RDONLY | SAFE_OPEN | flags, dir_fd=self.fd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno in NOT_REGULAR:
                raise NotRegular(name) from exc
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise NotRegular(name)
        return fd

    def create(self, name: str, flags: int = 0) -> int:
        """Create ``name`` (0600, write-only); it must not exist in any form, a link included."""
        return os.open(
            name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | SAFE_OPEN | flags, 0o600, dir_fd=self.fd
        )

    def rename(self, src: str, dst: str) -> None:
        os.replace(src, dst, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def remove(self, name: str, inode: int | None = None) -> Removal:
        """Unlink regular file ``name`` (only if it is still ``inode``, when given)."""
        return remove_regular(self.fd, name, inode)

    def remove_in(self, directory: str, name: str) -> Removal:
        """:meth:`remove` in namespace directory ``directory``: this one or a sibling
        (``GONE`` if that is missing or not a plain directory)."""
        if directory == self.path.name:
            return self.remove(name)
        with self.sibling(directory) as fd:
            return Removal.GONE if fd is None else remove_regular(fd, name)

    def names(self) -> list[str]:
        return os.listdir(self.fd)

    def scan(self) -> Iterator[Found | str]:
        """Every entry: a :class:`Found` regular file, or the name of anything else.

        Entries that vanish while listed (another process removed them) are skipped.
        """
        for name in self.names():
            st = self.lstat(name)
            if st is None:
                continue
            if stat.S_ISREG(st.st_mode):
                yield Found(name, st.st_size, charged_bytes(st), st.st_mtime_ns)
            else:
                yield name

    @contextlib.contextmanager
    def sibling(self, name: str) -> Iterator[int | None]:
        """Another namespace directory under the same root, opened without following a
        link; ``None`` if it is gone or is not a plain directory."""
        try:
            fd = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=self.root_fd)
        except OSError:
            yield None
            return
        try:
            yield fd
        finally:
            os.close(fd)


def is_regular(dir_fd: int, name: str) -> bool:
    """Whether ``name`` under ``dir_fd`` is a regular file (a link to one is not)."""
    try:
        return stat.S_ISREG(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except FileNotFoundError:
        return False


def remove_regular(dir_fd: int, name: str, inode: int | None = None) -> Removal:
    """Unlink ``name`` under ``dir_fd`` if it is a regular file (and still ``inode``)."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return Removal.GONE
    if not stat.S_ISREG(st.st_mode):
        return Removal.NOT_REGULAR
    if inode is not None and st.st_ino != inode:
        return Removal.REPLACED
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return Removal.GONE
    return Removal.REMOVED
