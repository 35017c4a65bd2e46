"""Sweeps of policy x capacity over one trace, as rows for tables, JSON and plots."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from kvoffload.replay.belady import belady_hits
from kvoffload.replay.loop import ReplayResult, replay
from kvoffload.replay.trace import Trace

__all__ = ["Row", "format_table", "sweep"]


@dataclass(frozen=True, slots=True)
class Row(ReplayResult):
    """One replay result, with the clairvoyant bound at its capacity."""

    #: Belady's prefix-hit ratio at ``capacity``; ``None`` when not computed.
    bound: float | None = None

    def as_dict(self) -> dict[str, object]:
        """The row as plain JSON-ready values, the derived ratios included."""
        return {**asdict(self), "hit_ratio": self.hit_ratio, "keys_per_s": self.keys_per_s}


def sweep(
    trace: Trace,
    capacities: Sequence[int],
    policies: Sequence[str],
    *,
    bound: bool = True,
    progress: bool = False,
) -> list[Row]:
    """Replay ``trace`` for every capacity and policy; Belady is run once per capacity."""
    rows: list[Row] = []
    blocks = trace.num_blocks
    for capacity in capacities:
        best = belady_hits(trace.requests, capacity) / blocks if bound and blocks else None
        for policy in policies:
            result = replay(trace, capacity, policy, progress=progress)
            rows.append(Row(**asdict(result), bound=best))
    return rows


def format_table(rows: Sequence[Row]) -> str:
    """A fixed-width text table: one line per row, the bound and the share of it reached."""
    header = ("policy", "capacity", "hit ratio", "keys/s", "bound", "of bound")
    lines = ["{:<10} {:>9} {:>9} {:>10} {:>6} {:>8}".format(*header)]
    for row in rows:
        bound = "-" if row.bound is None else f"{row.bound:.4f}"
        share = "-" if not row.bound else f"{row.hit_ratio / row.bound:.0%}"
        lines.append(
            f"{row.policy:<10} {row.capacity:>9} {row.hit_ratio:>9.4f} "
            f"{row.keys_per_s:>10,.0f} {bound:>6} {share:>8}"
        )
    return "\n".join(lines)
