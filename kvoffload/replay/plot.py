"""Hit ratio versus capacity, one line per policy plus the clairvoyant bound.

matplotlib is an optional dependency (``pip install 'kvoffload[plot]'``); it
is imported only here, through its object API (no ``pyplot``), so plotting
changes no global backend or state of the caller's process.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from kvoffload.errors import ConfigError
from kvoffload.replay.report import Row

__all__ = ["plot_hit_ratio"]

INSTALL_HINT = (
    "plotting needs matplotlib: pip install 'kvoffload[plot]' (or pip install matplotlib)"
)


class _Point(Protocol):
    """What a plotted row has: an index-only :class:`Row` or an engine replay's row."""

    @property
    def trace(self) -> str: ...
    @property
    def policy(self) -> str: ...
    @property
    def capacity(self) -> int: ...
    @property
    def hit_ratio(self) -> float: ...


def plot_hit_ratio(rows: Sequence[_Point], path: str | Path) -> Path:
    """Write a PNG of hit ratio against capacity (log scale) and return its path.

    Rows with a Belady ``bound`` (the index-only replay) get it drawn too.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ConfigError(INSTALL_HINT) from exc
    path = Path(path)
    figure = Figure(figsize=(7, 4.5), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for policy in dict.fromkeys(row.policy for row in rows):
        mine = sorted((r.capacity, r.hit_ratio) for r in rows if r.policy == policy)
        axes.plot([c for c, _ in mine], [h for _, h in mine], marker="o", label=policy)
    bounds = sorted(
        {(r.capacity, r.bound) for r in rows if isinstance(r, Row) and r.bound is not None}
    )
    if bounds:
        axes.plot(
            [c for c, _ in bounds], [b for _, b in bounds], "k--", marker="x", label="Belady bound"
        )
    if len({r.capacity for r in rows}) > 1:
        axes.set_xscale("log")
    axes.set_xlabel("capacity (chunks)")
    axes.set_ylabel("prefix-hit ratio")
    axes.set_ylim(bottom=0)
    axes.set_title(rows[0].trace if rows else "")
    axes.grid(True, alpha=0.3)
    axes.legend()
    try:
        figure.savefig(path, format="png", dpi=120)
    except OSError as exc:
        raise ConfigError(f"cannot write plot {str(path)!r}: {exc.strerror or exc}") from exc
    return path
