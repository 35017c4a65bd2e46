"""Sweeps of policy x capacity over one trace, as rows for tables, JSON and plots."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from kvoffload.replay.belady import belady_hits
from kvoffload.replay.loop import replay
from kvoffload.replay.trace import Trace

__all__ = ["Row", "format_table", "sweep"]


@dataclass(frozen=True, slots=True)
class Row:
    """One policy at one capacity, with the clairvoyant bound at that capacity."""

    trace: str
    policy: str
    capacity: int
    requests: int
    blocks: int
    hit_blocks: int
    hit_ratio: float
    keys_per_s: float
    #: Belady's prefix-hit ratio at ``capacity``; ``None`` when not computed.
    bound: float | None

    def as_dict(self) -> dict[str, object]:
        """The row as plain JSON-ready values."""
        return asdict(self)


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
            rows.append(
                Row(
                    trace=trace.name,
                    policy=result.policy,
                    capacity=capacity,
                    requests=result.requests,
                    blocks=result.blocks,
                    hit_blocks=result.hit_blocks,
                    hit_ratio=result.hit_ratio,
                    keys_per_s=result.keys_per_s,
                    bound=best,
                )
            )
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
