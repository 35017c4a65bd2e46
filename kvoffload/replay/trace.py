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

The engine replay and the demo need tokens: :meth:`Trace.tokens` expands each
hash id into its own reproducible 512 token ids (``input_length`` of them in
all), so requests sharing hash ids share exactly those tokens. The arrival
replay (:mod:`kvoffload.replay.arrivals`) needs each request's ``timestamp``
(milliseconds since the trace began, as Mooncake writes it).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np
import numpy.typing as npt

from kvoffload.config.values import safe_repr
from kvoffload.errors import ConfigError

__all__ = ["TRACE_BLOCK_TOKENS", "Trace", "block_key", "block_tokens", "load_trace"]

#: Hash ids are non-negative and fit in 64 bits in every public trace.
_KEY_BYTES = 8
#: Tokens per hash id, as in the public Mooncake traces.
TRACE_BLOCK_TOKENS = 512
#: Token ids are drawn below this (any size works: keys hash token ids).
_VOCAB = 1024


def block_key(hash_id: int) -> bytes:
    """The chunk key of one trace block: its prefix-chained hash id as 8 bytes."""
    return hash_id.to_bytes(_KEY_BYTES, "big")


def block_tokens(hash_id: int, n: int = TRACE_BLOCK_TOKENS) -> npt.NDArray[np.int64]:
    """The ``n`` token ids a trace block stands for: reproducible from its hash id alone.

    SHAKE-128 of the id, two bytes per token: one call per block, several
    times cheaper than a seeded numpy generator, and unrelated ids collide
    with negligible probability.
    """
    stream = hashlib.shake_128(hash_id.to_bytes(_KEY_BYTES, "little")).digest(2 * n)
    return (np.frombuffer(stream, "<u2") % _VOCAB).astype(np.int64)


@dataclass(frozen=True, slots=True)
class Trace:
    """The requests of one trace, as chunk keys, plus where they came from."""

    #: Display name (the file name) for reports.
    name: str
    #: One tuple of chunk keys per request, in trace order, prefix first.
    requests: tuple[tuple[bytes, ...], ...]
    #: Prompt tokens per request (``input_length``; all of its blocks when absent).
    lengths: tuple[int, ...] = ()
    #: Arrival of each request in seconds since the trace began (``timestamp``); empty when
    #: a request has none.
    arrivals: tuple[float, ...] = ()
    #: Tokens per hash id (512 in Mooncake's traces; 64 in the Claude Code one).
    block_tokens: int = TRACE_BLOCK_TOKENS

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
        return Trace(
            self.name, self.requests[:n], self.lengths[:n], self.arrivals[:n], self.block_tokens
        )

    def tokens(self, i: int) -> npt.NDArray[np.int64]:
        """Request ``i``'s prompt as token ids (see the module docstring)."""
        keys, size = self.requests[i], self.block_tokens
        length = self.lengths[i] if self.lengths else len(keys) * size
        blocks = [block_tokens(int.from_bytes(k, "big"), size) for k in keys]
        if length > len(keys) * size:  # a part block with no hash id: this request's own
            stream = hashlib.shake_128(b"part block %d" % i).digest(2 * size)
            blocks.append((np.frombuffer(stream, "<u2") % _VOCAB).astype(np.int64))
        return np.concatenate(blocks)[:length]


def _open(path: Path) -> IO[str]:
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    return path.open(encoding="utf-8")


#: Most hash ids one request may have: 32768 blocks are 16M (2^24) tokens, past any
#: context window, and past the largest prompt any configuration key accepts.
MAX_BLOCKS = 1 << 15


def _record(line: str, where: str, size: int) -> tuple[Sequence[int], int, float | None]:
    """``hash_ids``, the prompt length and the arrival (seconds, if given) of one line."""
    try:
        record = json.loads(line)
    except (ValueError, RecursionError) as exc:  # bad JSON, a number over 4300 digits
        raise ConfigError(f"{where}: not JSON ({exc}); expected one request per line") from exc
    ids = record.get("hash_ids") if isinstance(record, dict) else None
    if not isinstance(ids, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 1 << 64 for i in ids
    ):
        raise ConfigError(
            f"{where}: 'hash_ids' must be a list of non-negative 64-bit integers "
            "(Mooncake trace format)"
        )
    if len(ids) > MAX_BLOCKS:
        raise ConfigError(
            f"{where}: {len(ids):,} hash_ids are more blocks than any context window holds; "
            f"a request has at most {MAX_BLOCKS:,}"
        )
    assert isinstance(record, dict)
    arrival = _arrival(record.get("timestamp"), where)
    full = len(ids) * size
    length = record.get("input_length")
    if length is None:
        return ids, full, arrival
    # Up to a part block past the last id: some traces name whole blocks only.
    if isinstance(length, int) and not isinstance(length, bool) and 0 < length < full + size:
        return ids, length, arrival
    raise ConfigError(
        f"{where}: 'input_length' {safe_repr(length)} does not fit its {len(ids)} hash_ids: "
        f"give the prompt's tokens, from 1 to {full + size - 1:,} ({size} per hash id, and "
        "a part block), or leave it out"
    )


def _arrival(stamp: object, where: str) -> float | None:
    """A ``timestamp`` (milliseconds) in seconds; ``None`` when the line has none."""
    if stamp is None:
        return None
    if (
        isinstance(stamp, int | float)
        and not isinstance(stamp, bool)
        and math.isfinite(stamp)
        and 0 <= stamp < 1 << 53
    ):
        return stamp / 1000
    raise ConfigError(
        f"{where}: 'timestamp' {safe_repr(stamp)} is not a time: give milliseconds since the "
        "trace began (a number >= 0), or leave it out"
    )


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    try:
        with _open(path) as fh:
            yield from enumerate(fh, start=1)
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read trace {str(path)!r}: {exc}") from exc


def load_trace(
    path: str | Path, limit: int | None = None, block_tokens: int = TRACE_BLOCK_TOKENS
) -> Trace:
    """Read a Mooncake-format trace; ``limit`` keeps only its first requests, ``block_tokens``
    is the trace's tokens per hash id.

    Raises ``ConfigError`` naming the file (and line) if it is missing,
    unreadable, empty or not in the format, so the CLI prints one line.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"trace {str(path)!r} does not exist or is not a file")
    keys: dict[int, bytes] = {}
    requests: list[tuple[bytes, ...]] = []
    lengths: list[int] = []
    arrivals: list[float | None] = []
    for number, line in _lines(path):
        if limit is not None and len(requests) >= limit:
            break
        if not line.strip():
            continue
        ids, length, arrival = _record(line, f"{path.name}:{number}", block_tokens)
        # Interning one bytes object per id keeps memory flat and dict hits fast.
        requests.append(tuple([keys.get(i) or keys.setdefault(i, block_key(i)) for i in ids]))
        lengths.append(length)
        arrivals.append(arrival)
    if not requests:
        raise ConfigError(f"trace {str(path)!r} holds no requests")
    timed = tuple(a for a in arrivals if a is not None)
    return Trace(
        path.name,
        tuple(requests),
        tuple(lengths),
        timed if len(timed) == len(arrivals) else (),
        block_tokens,
    )
