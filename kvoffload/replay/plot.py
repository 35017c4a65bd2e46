"""Hit ratio versus capacity, one line per policy plus the clairvoyant bound.

matplotlib is an optional dependency (``pip install 'kvoffload[plot]'``); it
is imported only here, through its object API (no ``pyplot``), so plotting
changes no global backend or state of the caller's process.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from kvoffload.errors import ConfigError
from kvoffload.replay.report import Row

__all__ = ["check_plot_path", "plot_hit_ratio"]

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


def check_plot_path(path: str | Path) -> Path:
    """Refuse, before a replay that may take minutes, a plot that could not be written:
    no matplotlib, a missing or unwritable directory, a directory at the path."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ConfigError(INSTALL_HINT) from exc
    path = Path(path)
    folder = path.parent
    if path.is_dir():
        raise ConfigError(f"--plot {str(path)!r} is a directory; name a .png file")
    if not folder.is_dir():
        raise ConfigError(f"--plot {str(path)!r}: directory {str(folder)!r} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ConfigError(f"--plot {str(path)!r} cannot be written here (permission denied)")
    return path


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
