"""What a disk tier repairs at start: the leftovers of crashed processes, files the index lacks.

Run while other processes keep storing and loading in the same directory, so
each step checks before it deletes and tolerates entries that vanish under it:

* **Dead writers** (:func:`reap_dead_writers`): a store in flight has a row
  in the shared index (its reserved bytes) and a temp file named after its
  owner. Only an owner whose ``flock`` can be taken has exited; its temp files
  are removed and its reservations released. If it died between renaming a
  chunk into place and recording it, that chunk file is indexed instead of
  being lost or left uncounted.
* **The namespace directory** (:func:`reconcile`): chunk files no row
  names (a crash, an index removed by an operator, a directory from an
  older version) are indexed at the blocks they occupy, their mtime as last
  use; rows whose file is gone are dropped. Temp files of exited owners go;
  temp files that name no owner (older versions) go once older than
  :data:`STALE_TEMP_S`. Links, FIFOs, devices and directories are counted and
  left alone. The scan runs inside an index transaction, so no other process's
  rename interleaves with it.
"""

from __future__ import annotations

import os
import stat
import time
from functools import partial

from kvoffload.errors import IntegrityError
from kvoffload.tiers.disk._files import (
    Found,
    NamespaceDir,
    Removal,
    charged_bytes,
    chunk_name,
    parse_chunk_name,
    remove_regular,
)
from kvoffload.tiers.disk._index import Adopted, SharedIndex
from kvoffload.tiers.disk._owners import FRESH_OWNER, dead_owner, owner_of_temp, owner_tokens
from kvoffload.tiers.stats import TierCounters

__all__ = ["STALE_TEMP_S", "audit", "reap_dead_writers", "reconcile"]

#: Age after which a temp file that names no owner (written by an older version) is removed.
STALE_TEMP_S = 3600.0


def _cleanup_temp(dir_fd: int, counters: TierCounters, name: str) -> Adopted | None:
    """Remove a dead writer's temp file; the chunk file to index if it got renamed unrecorded."""
    removal = remove_regular(dir_fd, name)
    if removal is Removal.REMOVED:
        counters.add(temp_files_cleaned=1)
    elif removal is Removal.NOT_REGULAR:
        counters.add(not_regular_files=1)
    key_hex = name.split(".", 1)[0]
    try:
        key = bytes.fromhex(key_hex)
        st = _lstat(dir_fd, chunk_name(key))
    except ValueError:
        return None
    if st is None or not stat.S_ISREG(st.st_mode):
        return None
    return Adopted(key, charged_bytes(st), st.st_mtime_ns)


def _lstat(dir_fd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def reap_dead_writers(
    directory: NamespaceDir, index: SharedIndex, own: str, counters: TierCounters
) -> int:
    """Release every reservation, in any namespace, whose owner has exited; the count."""
    released = 0
    for ns, owner in index.writers():
        if owner == own:
            continue
        if _lstat(directory.root_fd, ns.hex()) is None:  # its directory and temp files are gone
            released += index.reap(ns, owner, lambda _name: None)
            continue
        with directory.sibling(ns.hex()) as dir_fd:
            if dir_fd is None:  # not a plain directory: nothing in it can be verified
                continue
            with dead_owner(dir_fd, owner) as dead:
                if dead:
                    released += index.reap(ns, owner, partial(_cleanup_temp, dir_fd, counters))
    return released


def reconcile(
    directory: NamespaceDir, index: SharedIndex, ns: bytes, own: str, counters: TierCounters
) -> tuple[int, int]:
    """Index this namespace's unrecorded chunk files, drop rows of vanished ones, remove
    dead owners' temp files; ``(indexed, dropped)``. See the module docstring."""

    def scan() -> list[Adopted]:
        chunks: list[Adopted] = []
        names = directory.names()
        for entry in directory.scan():
            if not isinstance(entry, Found):
                counters.add(not_regular_files=1)
            elif (key := parse_chunk_name(entry.name)) is not None:
                chunks.append(Adopted(key, entry.charged, entry.mtime_ns))
            elif entry.name.endswith((".tmp", FRESH_OWNER)):
                _clean_temp(directory, entry, own, counters)
        for token in owner_tokens(names) - {own}:  # owners with nothing left in flight
            with dead_owner(directory.fd, token):
                pass
        return chunks

    return index.reconcile(ns, scan)


def _clean_temp(directory: NamespaceDir, entry: Found, own: str, counters: TierCounters) -> None:
    owner = owner_of_temp(entry.name)
    if owner is None:
        if time.time_ns() - entry.mtime_ns < STALE_TEMP_S * 1e9:
            return
    elif owner == own:
        return
    else:
        with dead_owner(directory.fd, owner) as dead:
            if not dead:
                return
            if directory.remove(entry.name) is Removal.REMOVED:
                counters.add(temp_files_cleaned=1)
            return
    if directory.remove(entry.name) is Removal.REMOVED:
        counters.add(temp_files_cleaned=1)


def audit(directory: NamespaceDir, index: SharedIndex, ns: bytes, capacity: int) -> None:
    """``check_integrity`` of a disk tier: the index's totals against its rows and the
    capacity, namespace ``ns``'s rows against its directory, read in one transaction."""

    def chunk_files() -> dict[bytes, Found]:
        return {
            key: entry
            for entry in directory.scan()
            if isinstance(entry, Found) and (key := parse_chunk_name(entry.name)) is not None
        }

    totals, recount, rows, on_disk = index.audit(ns, chunk_files)
    if totals != recount or totals.used + totals.reserved > capacity:
        raise IntegrityError(
            f"disk index: totals {totals}, rows sum to {recount}, capacity {capacity} B"
        )
    wrong = {  # a row charges a file the tier wrote its length, one it found its blocks
        k.hex(): (size, (on_disk[k].size, on_disk[k].charged) if k in on_disk else None)
        for k, size in rows.items()
        if k not in on_disk or size not in (on_disk[k].size, on_disk[k].charged)
    }
    extra = len(on_disk.keys() - rows.keys())
    if wrong or extra:
        raise IntegrityError(
            f"disk index disagrees with {directory.path}: {len(wrong)} entries with a missing "
            f"or resized file (key: (indexed, on disk) {dict(list(wrong.items())[:3])}), "
            f"{extra} unindexed files"
        )
