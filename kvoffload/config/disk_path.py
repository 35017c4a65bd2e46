"""What ``disk_path`` must be before any engine starts on it, and what is worth a warning.

The disk tier opens ``disk_path`` at start and creates it (missing parents
included, 0700) when it does not exist. What it can never use is refused
here, at configuration time, so ``kvoffload plan``, the demo and engine start
give the same one-line error: a path that is a file, one under a file, and
one on a file system of the kernel's views (``/proc``, ``/sys``...), which
hold no files of ours. What may be intended is only noted
(:func:`disk_path_notes`): the directories that will be created, and a
budget larger than the free space (the tier would fill the disk before its
budget; stores then fail, counted, and the engine serves on).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from kvoffload.config.values import format_bytes
from kvoffload.errors import ConfigError

__all__ = ["check_disk_path", "disk_path_notes"]

#: File system types that are views of the kernel, not storage.
_PSEUDO_FS = frozenset(
    (
        "proc",
        "sysfs",
        "devtmpfs",
        "devpts",
        "cgroup",
        "cgroup2",
        "debugfs",
        "tracefs",
        "securityfs",
        "pstore",
        "bpf",
        "configfs",
        "fusectl",
        "mqueue",
        "efivarfs",
        "binfmt_misc",
        "autofs",
        "nsfs",
        "rpc_pipefs",
    )
)


def _existing(path: Path) -> tuple[Path, list[Path]]:
    """The deepest part of ``path`` that exists, and the directories below it to create."""
    missing: list[Path] = []
    for candidate in (path, *path.parents):
        if os.path.lexists(candidate):
            return candidate, list(reversed(missing))
        missing.append(candidate)
    return Path("/"), list(reversed(missing))  # pragma: no cover - "/" always exists


def _fs_type(path: Path) -> str | None:
    """The type of the file system holding ``path`` (Linux's mountinfo); None if unknown."""
    real = os.path.realpath(path)
    best, kind = "", None
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            fields = line.split(" - ", 1)
            mount = fields[0].split(" ")[4].replace("\\040", " ")
            inside = real == mount or real.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) >= len(best) and len(fields) == 2:
                best, kind = mount, fields[1].split(" ")[0]
    return kind


def check_disk_path(disk_path: str) -> None:
    """``ConfigError`` naming ``disk_path`` if no disk tier can ever live there."""
    path = Path(disk_path)
    existing, missing = _existing(path)
    if not existing.is_dir():
        what = "is" if not missing else f"lies under {str(existing)!r}, which is"
        raise ConfigError(
            f"disk_path {disk_path!r} {what} not a directory; point disk_path at a directory "
            "(it is created if missing)"
        )
    kind = _fs_type(existing)
    if kind in _PSEUDO_FS:
        raise ConfigError(
            f"disk_path {disk_path!r} is on a {kind} file system, a view of the kernel that "
            "holds no files; point disk_path at a directory on a local disk"
        )


def disk_path_notes(disk_path: str, disk_bytes_to_use: int) -> list[str]:
    """One line per thing a user may not expect: directories that will be created, and a
    budget larger than the file system's free space."""
    path = Path(disk_path)
    existing, missing = _existing(path)
    notes = []
    if missing:
        created = ", ".join(str(p) for p in missing)
        notes.append(
            f"disk_path {disk_path!r} does not exist: the disk tier creates {created} "
            f"(mode 0700) when it starts"
        )
    try:
        fs = os.statvfs(existing)
    except OSError:
        return notes
    free = fs.f_bavail * fs.f_frsize
    if disk_bytes_to_use > free:
        notes.append(
            f"disk_bytes_to_use {format_bytes(disk_bytes_to_use)} is more than the "
            f"{format_bytes(free)} free on the file system of {str(existing)!r} (chunks "
            "already stored there count in both): the disk fills before the budget does, "
            "and stores then fail (counted) while the engine serves on"
        )
    return notes
