"""Loading request traces in the Mooncake format.

A trace is a JSON-lines file (optionally gzip-compressed) with one request per
line; the only field replay needs is ``hash_ids``, one integer per prefix
block. Mooncake hash ids are already *prefix-chained*: id ``i`` of a request
names the whole token prefix up to the end of block ``i``, so two requests
share an id only if they share everything before it too. That is exactly what
a kvoffload chunk key means, so one block is one chunk and the key of a block
is its hash id packed to 8 big-endian bytes (:func:`block_key`); no rehashing
is needed, and packing happens once at load time so replay measures the index,
not the key derivation.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from kvoffload.errors import ConfigError

__all__ = ["Trace", "block_key", "load_trace"]

#: Hash ids are non-negative and fit in 64 bits in every public trace.
_KEY_BYTES = 8


def block_key(hash_id: int) -> bytes:
    """The chunk key of one trace block: its prefix-chained hash id as 8 bytes."""
    return hash_id.to_bytes(_KEY_BYTES, "big")


@dataclass(frozen=True, slots=True)
class Trace:
    """The requests of one trace, as chunk keys, plus where they came from."""

    #: Display name (the file name) for reports.
    name: str
    #: One tuple of chunk keys per request, in trace order, prefix first.
    requests: tuple[tuple[bytes, ...], ...]

    @property
    def num_blocks(self) -> int:
        """Blocks over all requests, repeats included: the hit-ratio denominator."""
        return sum(len(r) for r in self.requests)

    @property
    def num_unique(self) -> int:
        """Distinct chunk keys: the capacity at which nothing is ever evicted."""
        return len({k for r in self.requests for k in r})

    def head(self, n: int) -> Trace:
        """The first ``n`` requests, for quick runs and tests."""
        return Trace(self.name, self.requests[:n])


def _open(path: Path) -> IO[str]:
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    return path.open(encoding="utf-8")


def _hash_ids(line: str, where: str) -> Sequence[int]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: not JSON ({exc.msg}); expected one request per line") from exc
    ids = record.get("hash_ids") if isinstance(record, dict) else None
    if not isinstance(ids, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 1 << 64 for i in ids
    ):
        raise ConfigError(
            f"{where}: 'hash_ids' must be a list of non-negative 64-bit integers "
            "(Mooncake trace format)"
        )
    return ids


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    try:
        with _open(path) as fh:
            yield from enumerate(fh, start=1)
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read trace {str(path)!r}: {exc}") from exc


def load_trace(path: str | Path, limit: int | None = None) -> Trace:
    """Read a Mooncake-format trace; ``limit`` keeps only its first requests.

    Raises ``ConfigError`` naming the file (and line) if it is missing,
    unreadable, empty or not in the format, so the CLI prints one line.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"trace {str(path)!r} does not exist or is not a file")
    keys: dict[int, bytes] = {}
    requests: list[tuple[bytes, ...]] = []
    for number, line in _lines(path):
        if limit is not None and len(requests) >= limit:
            break
        if not line.strip():
            continue
        ids = _hash_ids(line, f"{path.name}:{number}")
        # Interning one bytes object per id keeps memory flat and dict hits fast.
        requests.append(tuple([keys.get(i) or keys.setdefault(i, block_key(i)) for i in ids]))
    if not requests:
        raise ConfigError(f"trace {str(path)!r} holds no requests")
    return Trace(path.name, tuple(requests))
