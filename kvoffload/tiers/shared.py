"""One CPU tier per engine: a shared-memory region that every tensor-parallel rank maps.

With tensor parallelism an engine runs one worker process per rank. Instead
of one private slab each, the ranks map one region of ``cpu_bytes_to_use``
(vLLM's budget is per engine): where every group is replicated (an MLA
model) all ranks view the whole region and read and write the same slots, so
a chunk is one copy; where groups are sharded each rank views its own part.

The region is a file under ``/dev/shm`` (POSIX shared memory, as
``multiprocessing.shared_memory`` makes it on Linux), mapped with ``mmap``
and viewed with ``torch.frombuffer``. A plain file rather than
``SharedMemory`` so that:

* its space is reserved at start: ``posix_fallocate`` fails with ``ENOSPC``
  there and then (a :class:`~kvoffload.errors.ConfigError` naming
  ``cpu_bytes_to_use`` and the space free), where a region merely truncated
  to size would kill a worker with ``SIGBUS`` when it first touches a page
  that tmpfs cannot back;
* its name carries the creating process's id, so a region that a crashed
  engine left is recognised and removed at the next start
  (:func:`remove_stale`), and no ``resource_tracker`` of another process
  unlinks or warns about it.

Lifetime: one rank :meth:`SharedRegion.create` s it and tells the others its
name (the vLLM adapter broadcasts it over the tensor-parallel group), they
:meth:`SharedRegion.attach`, and once every rank has mapped it the creator
:meth:`SharedRegion.unlink` s the name. From then on the memory lives
exactly as long as the last process that maps it: an engine's exit, or its
crash, leaves nothing under ``/dev/shm``. Only a crash between creation and
unlink can, and :func:`remove_stale` (run by the creator before it creates)
removes such files whose creator is gone.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import secrets
from pathlib import Path

import torch

from kvoffload.config.values import format_bytes
from kvoffload.errors import ConfigError

__all__ = ["SHM_DIR", "SharedRegion", "remove_stale"]

#: Where POSIX shared memory lives on Linux.
SHM_DIR = Path("/dev/shm")

_PREFIX = "kvoffload-cpu-"
_NAME = re.compile(rf"^{_PREFIX}(\d+)-[0-9a-f]+$")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def remove_stale(directory: Path = SHM_DIR) -> list[str]:
    """Unlink this user's regions under ``directory`` whose creating process is gone.

    Returns their names. A region still mapped by a live process loses only
    its name (the memory stays until that process exits); regions of live
    creators and other users' files are left alone.
    """
    removed = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(directory):
            match = _NAME.match(entry.name)
            if match is None or _alive(int(match.group(1))):
                continue
            with contextlib.suppress(OSError):
                if entry.stat(follow_symlinks=False).st_uid == os.getuid():
                    os.unlink(entry.path)
                    removed.append(entry.name)
    return removed


def _check_room(directory: Path, nbytes: int) -> None:
    """``ConfigError`` naming ``cpu_bytes_to_use`` if ``directory`` lacks ``nbytes`` free."""
    try:
        fs = os.statvfs(directory)
    except OSError as exc:
        raise ConfigError(
            f"the CPU tier's shared memory needs {directory}, which cannot be used: {exc}"
        ) from exc
    free = fs.f_bavail * fs.f_frsize
    if nbytes > free:
        raise ConfigError(_no_room(directory, nbytes, free))


def _no_room(directory: Path, nbytes: int, free: int) -> str:
    return (
        f"'cpu_bytes_to_use': the CPU tier shared by the engine's tensor-parallel ranks needs "
        f"{nbytes} bytes ({format_bytes(nbytes)}) of shared memory in {directory}, which has "
        f"{free} bytes ({format_bytes(free)}) free; lower 'cpu_bytes_to_use' or give "
        f"{directory} more room (in a container: docker run --shm-size)"
    )


class SharedRegion:
    """A mapped shared-memory file of ``nbytes``; see the module docstring."""

    def __init__(self, path: Path, nbytes: int, mapping: mmap.mmap, *, owner: bool) -> None:
        self.path = path
        self.nbytes = nbytes
        self.owner = owner
        self._mmap = mapping
        #: The whole region as one flat ``uint8`` tensor (page-aligned: an mmap is).
        self.tensor = torch.frombuffer(mapping, dtype=torch.uint8)
        self.pinned = False

    @property
    def name(self) -> str:
        return self.path.name

    @classmethod
    def create(cls, nbytes: int, directory: Path = SHM_DIR) -> SharedRegion:
        """Create and map a new region of ``nbytes`` with its space reserved.

        Regions left by crashed engines are removed first. Raises
        ``ConfigError`` naming ``cpu_bytes_to_use`` and the space free when
        ``directory`` cannot hold it.
        """
        directory = Path(directory)
        remove_stale(directory)
        _check_room(directory, nbytes)
        path = directory / f"{_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as exc:  # another process took the room since the check
                free = os.fstatvfs(fd).f_bavail * os.fstatvfs(fd).f_frsize
                raise ConfigError(f"{_no_room(directory, nbytes, free)} ({exc})") from exc
            mapping = mmap.mmap(fd, nbytes, mmap.MAP_SHARED)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        return cls(path, nbytes, mapping, owner=True)

    @classmethod
    def attach(cls, path: str | Path, nbytes: int) -> SharedRegion:
        """Map the region another rank created at ``path``; it must be ``nbytes`` long."""
        path = Path(path)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise ConfigError(f"cannot open the CPU tier's shared memory {path}: {exc}") from exc
        try:
            size = os.fstat(fd).st_size
            if size != nbytes:
                raise ConfigError(
                    f"the CPU tier's shared memory {path} is {size} bytes, this rank expects "
                    f"{nbytes}: the ranks disagree on the configuration"
                )
            mapping = mmap.mmap(fd, nbytes, mmap.MAP_SHARED)
        finally:
            os.close(fd)
        return cls(path, nbytes, mapping, owner=False)

    def unlink(self) -> None:
        """Remove the region's name (every rank has mapped it); the memory stays mapped."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def pin(self, start: int, nbytes: int) -> None:
        """Page-lock ``nbytes`` from ``start`` (a page boundary) for CUDA copies
        (``cudaHostRegister``), as a pinned slab is; each rank pins what it maps."""
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        err = cudart.cudaHostRegister(self.tensor.data_ptr() + start, nbytes, 0)
        if int(err) != 0:
            raise ConfigError(
                f"cannot pin {format_bytes(nbytes)} of the CPU tier's shared memory for "
                f"CUDA (cudaHostRegister: {err}); lower 'cpu_bytes_to_use'"
            )
        self.pinned = True
